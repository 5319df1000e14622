"""The ``modalgate`` command: serve, extproc, validate, check, schema.

Exit codes are part of the contract: ``validate`` 0 accepted, 1 rejected, 2 usage;
``check`` 0 valid, 1 invalid. A broken policy is printed as text, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Literal, get_args, get_origin

import orjson

from modalgate.errors import error_body
from modalgate.policy import Policy, PolicyError, RuleMatcher, load_policy, policy_json_schema
from modalgate.settings import Engine, EngineSpec, GatewaySettings, flag_name
from modalgate.validators import Verdict
from modalgate.validators.dialects import dialect_for
from modalgate.validators.request import Api

EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2
# vLLM's flags that change how it parses requests (``validate --engine vllm`` takes them).
VLLM_PARSING_FLAGS = ("enable_mm_embeds", "enable_prompt_embeds", "trust_request_mm_kwargs")


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
    _setting_flags(serve)
    serve.set_defaults(run=_serve)

    extproc = commands.add_parser(
        "extproc",
        help="decide inside Envoy: an ext_proc processor (gRPC) judging every request",
        description="The same gate as serve, asked by Envoy's ext_proc filter (docs/envoy.md)."
        " --host/--port serve /metrics, /healthz and /readyz over HTTP.",
    )
    extproc.add_argument(
        "--listen", default="127.0.0.1:9002", help="gRPC address (default 127.0.0.1:9002)"
    )
    _policy_args(extproc)
    _setting_flags(extproc)
    extproc.set_defaults(run=_extproc)

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
    validate.add_argument(
        "--engine",
        choices=get_args(Engine),
        help="read content parts as this server does, as the gate in front of it would "
        "(default: a rule's own engine, else openai)",
    )
    for vllm_flag in VLLM_PARSING_FLAGS:
        validate.add_argument(
            flag_name(vllm_flag),
            action="store_true",
            help=f"with --engine vllm: vLLM started with {flag_name(vllm_flag)}",
        )
    validate.set_defaults(run=_validate)

    check = commands.add_parser("check", help="check a policy file; exit 0 valid, 1 invalid")
    check.add_argument("policy", help="policy file (.yaml, .yml, .toml, .json)")
    check.set_defaults(run=_check)

    schema = commands.add_parser("schema", help="print the policy file's JSON Schema")
    schema.set_defaults(run=_schema)

    from modalgate.encoder_adapter.ray.cli import add_ray_commands  # imports no Ray

    add_ray_commands(commands)
    return parser


def _policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", help="policy file (default: the built-in table)")
    parser.add_argument("--mode", help="deployment mode, e.g. encoder (default: none)")


def _setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, made from the settings model: name, type, choices, help."""
    for name, field in GatewaySettings.model_fields.items():
        if name in ("policy", "mode"):
            continue  # _policy_args: validate takes them too
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        options: dict[str, Any] = {"dest": name, "metavar": extra.get("metavar")}
        annotation = field.annotation
        default = "" if field.default in (None, ()) else f" (default {field.default})"
        if annotation is bool:
            options = {"dest": name, "action": argparse.BooleanOptionalAction}
        elif get_origin(annotation) is Literal:
            options = {"dest": name, "choices": get_args(annotation)}
        elif annotation in (int, float):
            options["type"] = annotation
        elif get_origin(annotation) is tuple:  # given once per value: --api-key A --api-key B
            options["action"] = "append"
        parser.add_argument(flag_name(name), help=f"{field.description}{default}", **options)


def _load(args: argparse.Namespace) -> Policy | None:
    try:
        return load_policy(args.policy)
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return None


def _settings(args: argparse.Namespace) -> tuple[Policy, GatewaySettings] | None:
    """The policy and settings the flags, variables and policy file give; None (with
    the reason printed) where they do not."""
    from pydantic import ValidationError

    from modalgate.gateway.observability.logs import configure_logging
    from modalgate.settings import load_settings, policy_location

    flags = {name: getattr(args, name) for name in GatewaySettings.model_fields}
    flags["policy"] = policy_location(flags)
    try:
        policy = load_policy(flags["policy"])
        settings = load_settings(flags, policy.server.model_dump(exclude_none=True))
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return None
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            print(f"setting {where}: {error['msg']}", file=sys.stderr)
        return None
    configure_logging(settings.log_level, settings.log_format)
    return policy, settings


def _serve(args: argparse.Namespace) -> int:
    from modalgate.gateway.app import StartupError, create_app
    from modalgate.gateway.http.server import run_single, run_workers

    loaded = _settings(args)
    if loaded is None:
        return EXIT_USAGE
    policy, settings = loaded
    if settings.workers > 1:  # each worker builds its own gateway (gateway/http/server.py)
        return EXIT_OK if run_workers(settings) else EXIT_USAGE
    try:
        gateway = create_app(policy, settings=settings)
    except StartupError as exc:  # an operator's problem: one line, no traceback
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    run_single(gateway, settings)
    return EXIT_OK


def _extproc(args: argparse.Namespace) -> int:
    import asyncio

    from modalgate.gateway.app import StartupError, create_app

    try:
        from modalgate.gateway.service.extproc_grpc import serve_extproc
    except ImportError as exc:
        print(f"extproc needs gRPC: pip install 'modalgate[extproc]' ({exc})", file=sys.stderr)
        return EXIT_USAGE
    loaded = _settings(args)
    if loaded is None:
        return EXIT_USAGE
    policy, settings = loaded
    try:
        gateway = create_app(policy, settings=settings, extproc=True)
    except StartupError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    try:
        asyncio.run(serve_extproc(gateway, args.listen, settings.host, settings.port))
    except OSError as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return EXIT_USAGE
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

    from modalgate.gateway.gate.pipeline import Decider
    from modalgate.gateway.gate.remote_media import MediaStage

    engine = _engine(args)

    async def decide() -> Verdict:
        media = MediaStage(policy.media_urls) if args.fetch else None
        try:
            # A rule's own ``engine`` wins, as in the gateway; else --engine; else openai.
            dialect = (lambda rule: dialect_for(rule.engine or engine)) if engine else None
            matcher = RuleMatcher(policy, args.mode)
            decider = Decider(matcher, media, enforce=True, dialect=dialect)  # no shadow
            return (await decider.decide(body, args.api)).verdict
        finally:
            if media is not None:
                await media.aclose()

    return anyio.run(decide)


def _engine(args: argparse.Namespace) -> EngineSpec | None:
    """The server ``validate`` judges for: ``--engine``, with vLLM's parsing flags."""
    if args.engine is None:
        return None
    flags = {name: getattr(args, name) for name in VLLM_PARSING_FLAGS}
    return EngineSpec(name=args.engine, **(flags if args.engine == "vllm" else {}))


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
