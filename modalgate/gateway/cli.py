"""The ``modalgate`` command: serve, validate, check, schema.

Exit codes are part of the contract: ``validate`` 0 accepted, 1 rejected, 2 usage;
``check`` 0 valid, 1 invalid. A broken policy is printed as text, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import orjson

from modalgate.errors import error_body
from modalgate.policy import Policy, PolicyError, RuleMatcher, load_policy, policy_json_schema
from modalgate.validators import Verdict, validate_body

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

    serve = commands.add_parser("serve", help="run the gateway (HTTP)")
    _policy_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--log-level", default="info", help="uvicorn log level")
    serve.add_argument(
        "--encoder",
        metavar="NAME[:ARG]",
        help="serve POST /v1/encode with this encoder adapter, e.g. kimi:/models/kimi-vit",
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
    _policy_args(validate)
    validate.set_defaults(run=_validate)

    check = commands.add_parser("check", help="check a policy file; exit 0 valid, 1 invalid")
    check.add_argument("policy", help="policy file (.yaml, .yml, .toml, .json)")
    check.set_defaults(run=_check)

    schema = commands.add_parser("schema", help="print the policy file's JSON Schema")
    schema.set_defaults(run=_schema)
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


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from modalgate.encoder_adapter import create_encoder
    from modalgate.gateway.app import create_app

    policy = _load(args)
    if policy is None:
        return EXIT_USAGE
    try:
        encoder = create_encoder(args.encoder) if args.encoder else None
        app = create_app(policy=policy, mode=args.mode, encoder=encoder)
    except (LookupError, ValueError, OSError, RuntimeError) as exc:
        # An encoder that cannot load is an operator's problem: one line, no traceback.
        print(f"cannot start the encoder: {exc}", file=sys.stderr)
        return EXIT_USAGE
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
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
    verdict = validate_body(body, RuleMatcher(policy, args.mode))
    if args.fetch and verdict.accepted and verdict.remote_parts:
        verdict = _fetched(verdict, policy)
    if verdict.accepted:
        _print_json(verdict.to_dict())
        return EXIT_OK
    _print_json(error_body(verdict.violations))
    return EXIT_REJECTED


def _fetched(verdict: Verdict, policy: Policy) -> Verdict:
    import anyio

    from modalgate.gateway.remote_media import MediaStage

    async def fetch() -> None:
        stage = MediaStage(policy.media_urls)
        try:
            await stage.fetch(verdict)
        finally:
            await stage.aclose()

    anyio.run(fetch)
    return verdict


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
