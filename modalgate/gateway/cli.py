"""The ``modalgate`` command: serve, validate, check, schema.

Exit codes are part of the contract: ``validate`` 0 accepted, 1 rejected, 2 usage;
``check`` 0 valid, 1 invalid. A broken policy is printed as text, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import get_args

import orjson

from modalgate.errors import error_body
from modalgate.policy import Policy, PolicyError, RuleMatcher, load_policy, policy_json_schema
from modalgate.validators import Verdict
from modalgate.validators.request import Api

EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(args.run(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modalgate",
        description="Refuse multimodal requests a model cannot take, before they reach it.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the gateway (HTTP); in front of a model server with --upstream",
        description="Flags win over MODALGATE_* environment variables, which win over the "
        "policy file's server: section. See docs/deploy.md.",
    )
    _policy_args(serve)
    serve.add_argument("--upstream", metavar="URL", help="the model server to forward to")
    serve.add_argument(
        "--served-model",
        metavar="NAME",
        help="the model the upstream serves: requests are judged as it, whatever name they"
        " carry (default: the one policy-known model its /v1/models lists)",
    )
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument(
        "--encoder",
        metavar="NAME[:ARG]",
        help="encoder adapter for /v1/encode and embeds rewrites, e.g. kimi:/models/kimi-vit",
    )
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--log-format", choices=["json", "text"], help="default json")
    serve.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, help="one line per request"
    )
    serve.add_argument(
        "--watch-policy",
        action=argparse.BooleanOptionalAction,
        help="reload the policy file when it changes (SIGHUP always reloads)",
    )
    serve.add_argument(
        "--grace-period",
        dest="grace_period_s",
        type=float,
        metavar="S",
        help="on SIGTERM, seconds to let requests and streams in flight finish (default 30)",
    )
    serve.add_argument("--metrics-path", help="where Prometheus scrapes (default /metrics)")
    serve.add_argument(
        "--upstream-connect-timeout", dest="upstream_connect_timeout_s", type=float, metavar="S"
    )
    serve.add_argument(
        "--upstream-read-timeout",
        dest="upstream_read_timeout_s",
        type=float,
        metavar="S",
        help="longest silence between two chunks of a response (default 300)",
    )
    serve.add_argument(
        "--upstream-write-timeout",
        dest="upstream_write_timeout_s",
        type=float,
        metavar="S",
        help="longest time for the upstream to take one chunk of a request body (default 60)",
    )
    serve.add_argument("--upstream-max-connections", type=int, metavar="N")
    serve.add_argument("--upstream-health-path", metavar="PATH", help="default /health")
    serve.add_argument(
        "--upstream-health-interval",
        dest="upstream_health_interval_s",
        type=float,
        metavar="S",
        help="seconds between health probes of each upstream (default 5)",
    )
    serve.set_defaults(run=_serve)

    validate = commands.add_parser(
        "validate", help="check one request body; exit 0 accepted, 1 rejected"
    )
    validate.add_argument("request", help="request JSON file, or - for stdin")
    validate.add_argument(
        "--fetch",
        action="store_true",
        help="also download remote media (under the policy's media_urls rules) and check it",
    )
    validate.add_argument(
        "--api",
        choices=get_args(Api),
        default="chat",
        help="the request's shape: Chat Completions (messages, the default), Responses (input),"
        " or one of the other kinds of the policy's endpoints (docs/policy.md)",
    )
    _policy_args(validate)
    validate.set_defaults(run=_validate)

    check = commands.add_parser("check", help="check a policy file; exit 0 valid, 1 invalid")
    check.add_argument("policy", help="policy file (.yaml, .yml, .toml, .json)")
    check.set_defaults(run=_check)

    schema = commands.add_parser("schema", help="print the policy file's JSON Schema")
    schema.set_defaults(run=_schema)

    from modalgate.encoder_adapter.ray_serve import add_ray_commands  # imports no Ray

    add_ray_commands(commands)
    return parser


def _policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", help="policy file (default: the built-in table)")
    parser.add_argument("--mode", help="deployment mode, e.g. encoder (default: none)")


def _load(args: argparse.Namespace) -> Policy | None:
    try:
        return load_policy(args.policy)
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return None


_SERVE_FLAGS = (
    "policy",
    "mode",
    "upstream",
    "served_model",
    "encoder",
    "host",
    "port",
    "log_level",
    "log_format",
    "access_log",
    "watch_policy",
    "grace_period_s",
    "metrics_path",
    "upstream_connect_timeout_s",
    "upstream_read_timeout_s",
    "upstream_write_timeout_s",
    "upstream_max_connections",
    "upstream_health_path",
    "upstream_health_interval_s",
)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from modalgate.encoder_adapter import create_encoder
    from modalgate.gateway.app import Gateway
    from modalgate.gateway.logs import configure_logging, uvicorn_log_config
    from modalgate.gateway.settings import load_settings, policy_location

    flags = {name: getattr(args, name) for name in _SERVE_FLAGS}
    flags["policy"] = policy_location(flags)
    try:
        policy = load_policy(flags["policy"])
        settings = load_settings(flags, policy.server.model_dump(exclude_none=True))
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            print(f"setting {where}: {error['msg']}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(settings.log_level, settings.log_format)
    try:
        encoder = create_encoder(settings.encoder) if settings.encoder else None
    except (LookupError, ValueError, OSError, RuntimeError) as exc:
        # An encoder that cannot load is an operator's problem: one line, no traceback.
        print(f"cannot start the encoder: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        gateway = Gateway(policy, settings, encoder)
    except (LookupError, ValueError, OSError, RuntimeError) as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return EXIT_USAGE
    uvicorn.run(
        gateway,
        host=settings.host,
        port=settings.port,
        log_config=uvicorn_log_config(settings.log_level, settings.log_format),
        access_log=False,  # RequestId writes the access log, with the request id
        timeout_graceful_shutdown=settings.grace_period_s,
        server_header=False,  # the upstream's own Server and Date headers pass through
        date_header=False,
        # X-Forwarded-For is passed on as a chain, not folded into the client address.
        proxy_headers=False,
        lifespan="on",
    )
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    policy = _load(args)
    if policy is None:
        return EXIT_USAGE
    try:
        if args.request == "-":
            body = sys.stdin.buffer.read()
        else:
            with open(args.request, "rb") as file:
                body = file.read()
    except OSError as exc:
        print(f"{args.request}: cannot read ({exc.strerror})", file=sys.stderr)
        return EXIT_USAGE
    verdict = _decided(body, policy, args)
    if verdict.accepted:
        _print_json(verdict.to_dict())
        return EXIT_OK
    _print_json(error_body(verdict.violations))
    return EXIT_REJECTED


def _decided(body: bytes, policy: Policy, args: argparse.Namespace) -> Verdict:
    """The gateway's own decision (fallback included); remote media fetched with --fetch."""
    import anyio

    from modalgate.gateway.pipeline import Decider
    from modalgate.gateway.remote_media import MediaStage

    async def decide() -> Verdict:
        media = MediaStage(policy.media_urls) if args.fetch else None
        try:
            decider = Decider(RuleMatcher(policy, args.mode), media)
            return (await decider.decide(body, args.api)).verdict
        finally:
            if media is not None:
                await media.aclose()

    return anyio.run(decide)


def _check(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_REJECTED
    modes = sorted({r.mode for r in policy.models if r.mode})
    print(
        f"{args.policy}: ok ({len(policy.models)} model rules"
        + (f"; modes: {', '.join(modes)}" if modes else "")
        + ")"
    )
    return EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    _print_json(policy_json_schema())
    return EXIT_OK


def _print_json(value: object) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
