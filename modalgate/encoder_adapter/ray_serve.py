"""The encoder pool on Ray Serve: many encoder replicas across GPUs and nodes, many gateways.

Ray Serve places the replicas (``num_gpus``/``num_cpus`` each), restarts the ones
that die and autoscales them; modalgate grows no cluster manager of its own.

* ``EncoderReplica`` (this module): each replica builds any registered adapter
  with ``create_encoder(spec)`` (``kimi:DIR``: the Kimi preprocessor and the
  transformers tower) and answers ``encode(images)``. Requests meet in that
  adapter's own micro-batcher (``batching="modalgate"``, the default) or first in
  Ray Serve's ``@serve.batch`` (``batching="serve"``).
* Deploying it (this module): ``modalgate ray deploy`` (``add_ray_commands``), a
  Serve config file whose ``import_path`` is
  ``modalgate.encoder_adapter.ray_serve:app_builder`` (``--print-config`` writes
  one), or ``deploy(PoolConfig(...))``.
* ``RayServeEncoder`` (``ray_client``, also importable from here): the
  gateway-side adapter behind ``--encoder ray:APP`` or ``encoder: ray:APP``.

Embeddings travel as numpy arrays in a pickled reply: Ray serialises them with
pickle protocol 5 and out-of-band buffers (big ones through the shared-memory
object store, read without a copy), so no base64 and no JSON cross the hop.
Ray is imported only when a pool is built or called, so ``modalgate --help``
stays fast and works without the ``ray`` extra.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from modalgate.encoder_adapter.batching import Overloaded
from modalgate.encoder_adapter.protocol import Encoded, EncoderAdapter
from modalgate.settings import RaySettings

logger = logging.getLogger("modalgate.encoder.ray")

ADDRESS_ENV = "MODALGATE_RAY_ADDRESS"  # read through modalgate.settings.RaySettings
DEFAULT_APP = "modalgate-encoder"
DEPLOYMENT = "EncoderReplica"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
Batching = Literal["modalgate", "serve"]


@dataclass(frozen=True, slots=True)
class PoolReply:
    """A replica's answer: one result per image (embeddings as numpy arrays), or a refusal."""

    replica: str
    results: list[Encoded] = field(default_factory=list)
    retry_after_s: float | None = None  # set when the replica's own queue was full


class EncoderReplica:
    """One replica of the pool: any registered adapter, behind Ray Serve's routing.

    The constructor is async (Ray Serve awaits it) so the adapter's warm-up forward
    pass runs before the replica is marked ready and gets traffic.
    """

    async def __init__(  # type: ignore[misc]
        self,
        spec: str,
        batching: Batching = "modalgate",
        serve_batch_size: int = 16,
        serve_batch_wait_s: float = 0.005,
    ) -> None:
        from ray import serve

        from modalgate.encoder_adapter.registry import create_encoder

        check_batching(batching)
        self.adapter: EncoderAdapter = create_encoder(spec)
        await self.adapter.warmup()
        self.batching = batching
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.requests = 0
        self.ongoing = 0
        self.images = 0
        self.calls = 0  # adapter.encode calls: fewer than requests when @serve.batch merges
        self._batched = serve.batch(
            max_batch_size=serve_batch_size,
            batch_wait_timeout_s=serve_batch_wait_s,
            batch_size_fn=lambda requests: sum(len(r) for r in requests),
        )(self._encode_merged)

    async def encode(self, images: list[bytes], batching: Batching | None = None) -> PoolReply:
        """``batching`` overrides the deployment's choice for this request: both paths live in
        every replica, so the two can be compared on the same replicas, interleaved."""
        self.requests += 1
        self.ongoing += 1
        self.images += len(images)
        try:
            if check_batching(batching or self.batching) == "serve":
                results: list[Encoded] = await self._batched(images)
            else:
                self.calls += 1
                results = await self.adapter.encode(images)
        except Overloaded as exc:  # travels as data: exceptions cross Ray wrapped
            return PoolReply(self.replica, retry_after_s=exc.retry_after_s)
        finally:
            self.ongoing -= 1
        return PoolReply(self.replica, [_to_wire(result) for result in results])

    async def info(self) -> dict[str, Any]:
        """Who and how busy: for tests, benchmarks and operators (``handle.broadcast``)."""
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "batching": self.batching,
            "requests": self.requests,
            "ongoing": self.ongoing,
            "images": self.images,
            "calls": self.calls,
            # Forward passes of adapters with a micro-batcher (the local ones): batching at work.
            "batches": getattr(getattr(self.adapter, "batcher", None), "batches", None),
        }

    async def _encode_merged(self, requests: list[list[bytes]]) -> list[list[Encoded]]:
        """@serve.batch's side: the requests it gathered, encoded as one list of images."""
        self.calls += 1
        flat = [image for images in requests for image in images]
        results = await self.adapter.encode(flat)
        out, start = [], 0
        for images in requests:
            out.append(results[start : start + len(images)])
            start += len(images)
        return out


def check_batching(batching: str) -> Batching:
    if batching not in ("modalgate", "serve"):
        raise ValueError(f"batching must be 'modalgate' or 'serve', not {batching!r}")
    return batching  # type: ignore[return-value]


def _to_wire(result: Encoded) -> Encoded:
    if result.embedding is None:
        return result
    array = result.embedding.detach().to("cpu").float().contiguous().numpy()
    return Encoded(embedding=array, grid_thw=result.grid_thw, cached=result.cached)


def connect(address: str | None = None) -> None:
    """Join the Ray cluster as a driver (once per process); replicas' logs stay on the cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address or RaySettings().address,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )


@dataclass(frozen=True)
class PoolConfig:
    """What ``modalgate ray deploy`` and ``app_builder`` take; every field has a CLI flag."""

    spec: str  # the adapter each replica builds, e.g. "kimi:/models/kimi-k2.5"
    num_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Ray Serve's autoscaling_config (min_replicas, max_replicas, target_ongoing_requests,
    # ...); when set it replaces num_replicas.
    autoscaling: dict[str, Any] | None = None
    batching: Batching = "modalgate"
    serve_batch_size: int = 16  # images per @serve.batch call (batching="serve" only)
    serve_batch_wait_s: float = 0.005
    # Requests one replica holds at once: the batcher can only batch what it is given.
    max_ongoing_requests: int = 64
    # Requests one gateway may queue for the pool; beyond that: 503 encoder_overloaded.
    max_queued_requests: int = 256
    health_check_period_s: float = 2.0

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period_s,
        }
        if self.autoscaling:
            options["autoscaling_config"] = dict(self.autoscaling)
        else:
            options["num_replicas"] = self.num_replicas
        return options


def build_app(config: PoolConfig) -> Any:
    """The Serve application (``serve.run(build_app(...), name=APP, route_prefix=None)``)."""
    from ray import serve

    deployment = serve.deployment(EncoderReplica, name=DEPLOYMENT)
    return deployment.options(**config.deployment_options()).bind(
        config.spec, config.batching, config.serve_batch_size, config.serve_batch_wait_s
    )


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files and ``serve run``: ``import_path: ...ray_serve:app_builder``,
    ``args`` the fields of ``PoolConfig`` (``spec`` at least)."""
    return build_app(PoolConfig(**args))


def config_yaml(config: PoolConfig, app: str = DEFAULT_APP) -> dict[str, Any]:
    """The same pool as a Serve config (``serve deploy`` / ``serve run FILE``): what the
    replicas are in ``args``, how many and how big in ``deployments`` (Serve's own keys,
    which operators edit there)."""
    replica_args = ("batching", "serve_batch_size", "serve_batch_wait_s")
    args = {"spec": config.spec}
    args.update({k: v for k, v in asdict(config).items() if k in replica_args})
    args = {k: v for k, v in args.items() if k == "spec" or v != getattr(PoolConfig, k)}
    deployment = {"name": DEPLOYMENT, **config.deployment_options()}
    return {
        "applications": [
            {
                "name": app,
                "route_prefix": None,
                "import_path": f"{__name__}:app_builder",
                "args": args,
                "deployments": [deployment],
            }
        ]
    }


def deploy(config: PoolConfig, app: str = DEFAULT_APP, wait: bool = True) -> None:
    """Deploy (or update in place) the pool on the cluster this process is connected to.

    Where Serve is not running yet it starts without HTTP proxies: the pool is reached
    through deployment handles only. ``wait=False`` returns before replicas run.
    """
    from ray import serve

    serve.start(proxy_location="Disabled")
    target = serve.RunTarget(target=build_app(config), name=app, route_prefix=None)
    serve.run_many([target], wait_for_applications_running=wait)


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
    deploy.add_argument("--replicas", type=int, default=defaults.num_replicas)
    deploy.add_argument(
        "--min-replicas", type=int, help="autoscale between --min-replicas and --max-replicas"
    )
    deploy.add_argument("--max-replicas", type=int)
    deploy.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=8.0,
        help="autoscaling target per replica (default 8)",
    )
    deploy.add_argument("--num-cpus", type=float, default=defaults.num_cpus)
    deploy.add_argument("--num-gpus", type=float, default=defaults.num_gpus)
    deploy.add_argument(
        "--batching",
        choices=["modalgate", "serve"],
        default=defaults.batching,
        help="modalgate's micro-batcher in each replica (default) or Ray Serve's @serve.batch",
    )
    deploy.add_argument("--max-ongoing-requests", type=int, default=defaults.max_ongoing_requests)
    deploy.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests)
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


def __getattr__(name: str) -> Any:
    """``RayServeEncoder`` and ``ray_encoder`` live in ``ray_client`` (which imports this
    module); importing them from here works too, and the registry names this module."""
    if name in ("RayServeEncoder", "ray_encoder"):
        from modalgate.encoder_adapter import ray_client

        return getattr(ray_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
