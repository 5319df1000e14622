"""``modalgate ray deploy``: the encoder pool deployed from the command line.

The flags make a ``ray.serve.PoolConfig``; ``--print-config`` writes the same pool as a
Serve config file instead of deploying it. Ray is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from modalgate.encoder_adapter.ray.contract import ADDRESS_ENV, DEFAULT_APP, connect
from modalgate.encoder_adapter.ray.serve import PoolConfig, config_yaml, deploy

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "add_ray_commands", "pool_config"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_ray_commands(subparsers: Any) -> None:
    """Add ``ray deploy`` to the ``modalgate`` command's subparsers."""
    defaults = PoolConfig(spec="")
    ray = subparsers.add_parser("ray", help="the encoder pool on Ray Serve")
    commands = ray.add_subparsers(dest="ray_command", metavar="COMMAND")
    ray.set_defaults(run=lambda args: _usage(ray))

    deploy = commands.add_parser(
        "deploy", help="deploy the encoder pool; gateways use it with --encoder ray:NAME"
    )
    deploy.add_argument(
        "--encoder",
        required=True,
        metavar="NAME[:ARG]",
        help="the adapter every replica builds, e.g. kimi:/models/kimi-k2.5",
    )
    deploy.add_argument("--name", default=DEFAULT_APP, help=f"application name ({DEFAULT_APP})")
    deploy.add_argument(
        "--address", help=f"Ray cluster address (default: ${ADDRESS_ENV}, else auto)"
    )
    deploy.add_argument(
        "--replicas",
        type=int,
        default=defaults.num_replicas,
        help="replicas to run; with autoscaling, the initial count"
        f" (default {defaults.num_replicas})",
    )
    deploy.add_argument(
        "--min-replicas", type=int, help="autoscale between --min-replicas and --max-replicas"
    )
    deploy.add_argument(
        "--max-replicas",
        type=int,
        help="autoscaling's upper bound (default: the larger of --replicas and --min-replicas)",
    )
    deploy.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=8.0,
        help="autoscaling target per replica (default 8)",
    )
    deploy.add_argument(
        "--num-cpus",
        type=float,
        default=defaults.num_cpus,
        help=f"CPUs Ray reserves for each replica (default {defaults.num_cpus:g})",
    )
    deploy.add_argument(
        "--num-gpus",
        type=float,
        default=defaults.num_gpus,
        help=f"GPUs for each replica, fractions share one (default {defaults.num_gpus:g})",
    )
    deploy.add_argument(
        "--batching",
        choices=["modalgate", "serve"],
        default=defaults.batching,
        help="modalgate's micro-batcher in each replica (default) or Ray Serve's @serve.batch",
    )
    deploy.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=defaults.max_ongoing_requests,
        help="requests one replica holds at once; the batcher batches only what it holds"
        f" (default {defaults.max_ongoing_requests})",
    )
    deploy.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="requests one gateway may queue for the pool; beyond: 503 encoder_overloaded"
        f" (default {defaults.max_queued_requests})",
    )
    deploy.add_argument(
        "--no-wait", action="store_true", help="return before the replicas are running"
    )
    deploy.add_argument(
        "--print-config",
        action="store_true",
        help="print the pool as a Serve config file (for serve deploy) and exit",
    )
    deploy.set_defaults(run=_deploy)


def pool_config(args: argparse.Namespace) -> Any:
    """The ``PoolConfig`` the flags describe (autoscaling when a min or max is given)."""
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        low = args.min_replicas if args.min_replicas is not None else 1
        high = args.max_replicas if args.max_replicas is not None else max(low, args.replicas)
        if not 0 <= low <= high or high < 1:
            raise ValueError("need 0 <= --min-replicas <= --max-replicas, max at least 1")
        autoscaling = {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": max(low, min(high, args.replicas)),
            "target_ongoing_requests": args.target_ongoing_requests,
        }
    elif args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    return PoolConfig(
        spec=args.encoder,
        num_replicas=args.replicas,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        autoscaling=autoscaling,
        batching=args.batching,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
    )


def _deploy(args: argparse.Namespace) -> int:
    import yaml

    try:
        config = pool_config(args)
    except ValueError as exc:
        print(f"modalgate ray deploy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_config:
        document = config_yaml(config, args.name)
        sys.stdout.write(yaml.safe_dump(document, sort_keys=False))
        return EXIT_OK
    try:
        connect(args.address)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        print(f"cannot reach the Ray cluster: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        deploy(config, args.name, wait=not args.no_wait)
    except Exception as exc:  # Serve reports a failed deployment as RuntimeError and kin
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"the encoder pool {args.name!r} did not deploy: {first}", file=sys.stderr)
        return EXIT_FAILED
    state = "deploying" if args.no_wait else "running"
    print(f"{args.name}: {state} ({config.spec}); gateways: --encoder ray:{args.name}")
    return EXIT_OK


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE
