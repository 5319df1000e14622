"""The encoder pool's replicas on Ray Serve, and deploying them.

Ray Serve places the replicas (``num_gpus``/``num_cpus`` each), restarts the ones
that die and autoscales them; modalgate grows no cluster manager of its own.

* ``EncoderReplica``: each replica builds any registered adapter with
  ``create_encoder(spec)`` (``kimi:DIR``: the Kimi preprocessor and the
  transformers tower) and answers ``encode(images)``. Requests meet in that
  adapter's own micro-batcher (``batching="modalgate"``, the default) or first in
  Ray Serve's ``@serve.batch`` (``batching="serve"``).
* Deploying it: ``modalgate ray deploy`` (``ray.cli``), a Serve config file whose
  ``import_path`` is ``modalgate.encoder_adapter.ray.serve:app_builder``
  (``--print-config`` writes one), or ``deploy(PoolConfig(...))``.

The gateway side (``ray.client``) does not import this module, nor this module it:
what both need is ``ray.contract``'s. Ray is imported only when a pool is built or
called, so ``modalgate --help`` stays fast and works without the ``ray`` extra.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from modalgate.encoder_adapter.batching import Overloaded
from modalgate.encoder_adapter.protocol import Encoded, EncoderAdapter
from modalgate.encoder_adapter.ray.contract import (
    DEFAULT_APP,
    DEPLOYMENT,
    Batching,
    PoolReply,
    check_batching,
    to_wire,
)

__all__ = ["EncoderReplica", "PoolConfig", "app_builder", "build_app", "config_yaml", "deploy"]


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
        return PoolReply(self.replica, [to_wire(result) for result in results])

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
    """For Serve config files and ``serve run``: ``import_path: ...ray.serve:app_builder``,
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


_PICKLE_RACE_ATTEMPTS = 3


def deploy(config: PoolConfig, app: str = DEFAULT_APP, wait: bool = True) -> None:
    """Deploy (or update in place) the pool on the cluster this process is connected to.

    Where Serve is not running yet it starts without HTTP proxies: the pool is reached
    through deployment handles only. ``wait=False`` returns before replicas run.
    """
    from ray import serve

    serve.start(proxy_location="Disabled")
    for attempt in range(_PICKLE_RACE_ATTEMPTS):
        try:
            target = serve.RunTarget(target=build_app(config), name=app, route_prefix=None)
            serve.run_many([target], wait_for_applications_running=wait)
            return
        except ValueError as exc:
            # Serve registers and unregisters modules for cloudpickle on a process-wide
            # registry without a lock; a handle's thread doing the same in this process
            # can unregister ours first. Raised while pickling, before anything is sent.
            if "registered for pickle by value" not in str(exc) or (
                attempt == _PICKLE_RACE_ATTEMPTS - 1
            ):
                raise
