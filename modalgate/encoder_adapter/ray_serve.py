"""The encoder pool on Ray Serve: many encoder replicas across GPUs and nodes, many gateways.

Ray Serve places the replicas (``num_gpus``/``num_cpus`` each), restarts the ones
that die and autoscales them; modalgate grows no cluster manager of its own.
Two halves:

* ``EncoderReplica``, deployed by ``build_app`` (or ``app_builder`` from a Serve
  config file, or ``modalgate ray deploy``): each replica builds any registered
  adapter with ``create_encoder(spec)`` (``kimi:DIR``: the Kimi preprocessor and
  the transformers tower) and answers ``encode(images)``. Concurrent requests
  meet in that adapter's own micro-batcher (``batching="modalgate"``, the
  default) or in Ray Serve's ``@serve.batch`` first (``batching="serve"``).
* ``RayServeEncoder`` (``--encoder ray:APP``, or ``encoder: ray:APP`` in a policy
  rule): the gateway-side adapter, calling the pool through a deployment handle.

Embeddings travel as numpy arrays in a pickled reply: Ray serialises them with
pickle protocol 5 and out-of-band buffers (big ones through the shared-memory
object store, read without a copy), so no base64 and no JSON cross the hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from modalgate.encoder_adapter.batching import Overloaded
from modalgate.encoder_adapter.protocol import Encoded, EncoderAdapter
from modalgate.errors import ErrorCode, Violation

logger = logging.getLogger("modalgate.encoder.ray")

ADDRESS_ENV = "MODALGATE_RAY_ADDRESS"  # where the Ray cluster is; default "auto"
TIMEOUT_ENV = "MODALGATE_RAY_TIMEOUT_S"
RETRIES_ENV = "MODALGATE_RAY_RETRIES"
DEFAULT_APP = "modalgate-encoder"
DEPLOYMENT = "EncoderReplica"
Batching = Literal["modalgate", "serve"]


@dataclass(frozen=True, slots=True)
class PoolReply:
    """A replica's answer: one result per image (embeddings as numpy arrays), or a refusal."""

    replica: str
    results: list[Encoded] = field(default_factory=list)
    retry_after_s: float | None = None  # set when the replica's own queue was full


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

        _check_batching(batching)
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
            if _check_batching(batching or self.batching) == "serve":
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


def _check_batching(batching: str) -> Batching:
    if batching not in ("modalgate", "serve"):
        raise ValueError(f"batching must be 'modalgate' or 'serve', not {batching!r}")
    return batching  # type: ignore[return-value]


def _to_wire(result: Encoded) -> Encoded:
    if result.embedding is None:
        return result
    array = result.embedding.detach().to("cpu").float().contiguous().numpy()
    return Encoded(embedding=array, grid_thw=result.grid_thw, cached=result.cached)


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
    """The same pool as a Serve config (``serve deploy`` / ``serve run FILE``)."""
    args = {k: v for k, v in asdict(config).items() if v != getattr(PoolConfig, k, None)}
    args["spec"] = config.spec
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


# ---------------------------------------------------------------- the gateway side


def connect(address: str | None = None) -> None:
    """Join the Ray cluster as a driver (once per process); replicas' logs stay on the cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address or os.environ.get(ADDRESS_ENV) or "auto",
            log_to_driver=False,
            logging_level=logging.WARNING,
        )


class RayServeEncoder:
    """The pool as an adapter: ``encode`` sends the whole request to one replica.

    Encoding is idempotent, so a request whose replica died mid-way is sent again
    (``retries`` times, Ray Serve routes it to a live replica), and only then fails
    with ``encoder_error``. No running replica (every one dead, or none placed) is
    ``Overloaded`` at once (503 with Retry-After), noticed by a status probe every
    ``health_interval_s``; a pool that stays silent past ``timeout_s`` is too.
    """

    name = "ray"
    modalities = frozenset({"image"})

    def __init__(
        self,
        app: str = DEFAULT_APP,
        *,
        address: str | None = None,
        retries: int = 1,
        timeout_s: float = 30.0,
        health_interval_s: float = 1.0,
        unavailable_retry_after_s: float = 5.0,
        max_batch: int = 16,
        batching: Batching | None = None,
    ) -> None:
        from ray import serve
        from ray.serve.exceptions import RayServeException

        connect(address)
        self.app = app
        self.retries = retries
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self.unavailable_retry_after_s = unavailable_retry_after_s
        self.max_batch = max_batch
        self.batching = _check_batching(batching) if batching else None
        try:
            self._handle = serve.get_app_handle(app)
        except RayServeException as exc:
            raise LookupError(f"no Ray Serve application {app!r} on the cluster") from exc
        self.replicas: Counter[str] = Counter()  # requests answered, per replica
        self.retried = 0
        self.failed = 0
        self._healthy = self._probe()
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch, name=f"modalgate-ray-{app}", daemon=True
        )
        self._monitor.start()

    @property
    def healthy(self) -> bool:
        return self._healthy

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        if not images:
            return []
        if not self._healthy:
            raise Overloaded(self.unavailable_retry_after_s)
        payload = list(images)
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(self.retries + 1):
            try:
                reply = await self._call(payload, deadline)
            except Overloaded:
                raise
            except BackPressureError as exc:
                raise Overloaded(exc.retry_after_s or 1.0) from None
            except DeploymentUnavailableError:
                raise Overloaded(self.unavailable_retry_after_s) from None
            except _replica_lost_errors() as exc:
                if attempt < self.retries:
                    self.retried += 1
                    logger.warning("encoder replica lost mid-request (%s); retrying", _short(exc))
                    continue
                logger.error("encoder replica lost mid-request (%s); giving up", _short(exc))
            except (RayTaskError, RayActorError, Exception):  # a bug, not a lost replica
                logger.exception("the encoder pool failed on a request")
            else:
                return self._unpack(reply)
            break
        self.failed += 1
        return [Encoded(error=_failed()) for _ in images]

    async def warmup(self) -> None:
        """Replicas warm themselves before taking traffic; this side loads torch (embeddings
        arrive as torch tensors) so the first request does not pay for the import."""
        await asyncio.to_thread(importlib.import_module, "torch")

    async def close(self) -> None:
        self._stop.set()

    async def info(self) -> list[dict[str, Any]]:
        """``EncoderReplica.info`` of every running replica."""
        response = self._handle.broadcast("info")
        return await response.results_async(timeout_s=self.timeout_s)

    async def _call(self, images: list[bytes], deadline: float) -> PoolReply:
        """One attempt; gives up early when the status probe sees no running replica."""
        response = self._handle.encode.remote(images, self.batching)
        task: asyncio.Future[PoolReply] = asyncio.ensure_future(_awaited(response))
        try:
            while True:
                remaining = deadline - time.monotonic()
                done, _ = await asyncio.wait({task}, timeout=min(self.health_interval_s, remaining))
                if done:
                    return task.result()
                if not self._healthy or time.monotonic() >= deadline:
                    raise Overloaded(self.unavailable_retry_after_s)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(Exception):
                    response.cancel()

    def _unpack(self, reply: PoolReply) -> list[Encoded]:
        if reply.retry_after_s is not None:
            raise Overloaded(reply.retry_after_s)
        self.replicas[reply.replica] += 1
        return [_from_wire(result) for result in reply.results]

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            self._healthy = self._probe()

    def _probe(self) -> bool:
        """At least one RUNNING replica, or an app the autoscaler scaled to zero on purpose
        (then a request is what brings a replica back, so it must go through)."""
        from ray import serve

        try:
            application = serve.status().applications.get(self.app)
        except Exception:  # the controller is briefly away: keep the last answer
            logger.warning("cannot read the status of the encoder pool", exc_info=True)
            return getattr(self, "_healthy", True)
        if application is None:
            return False
        states: Counter[str] = Counter()
        for deployment in application.deployments.values():
            for state, count in deployment.replica_states.items():
                states[str(getattr(state, "value", state))] += count
        if states["RUNNING"] > 0:
            return True
        return not sum(states.values()) and str(application.status.value) == "RUNNING"


async def _awaited(response: Any) -> PoolReply:
    return await response


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    """A replica process gone (killed, node lost) or unreachable: worth another replica."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import ReplicaUnavailableError

    return (ActorDiedError, ActorUnavailableError, ReplicaUnavailableError)


def _short(exc: BaseException) -> str:
    """Ray's actor-death text runs to a page; the log needs its first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _from_wire(result: Encoded) -> Encoded:
    """numpy back to torch without a copy (the array may be a read-only view of the object
    store; the tensor shares it, and nobody in modalgate writes into an embedding)."""
    if result.embedding is None:
        return result
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        tensor = torch.from_numpy(result.embedding)
    return Encoded(embedding=tensor, grid_thw=result.grid_thw, cached=result.cached)


def _failed() -> Violation:
    return Violation(ErrorCode.ENCODER_ERROR, "the encoder failed on this image")


def ray_encoder(arg: str | None) -> RayServeEncoder:
    """Registry factory: ``ray:APP`` (default app ``modalgate-encoder``); the cluster address
    from ``MODALGATE_RAY_ADDRESS`` (default ``auto``), timeout and retries from
    ``MODALGATE_RAY_TIMEOUT_S`` and ``MODALGATE_RAY_RETRIES``."""
    return RayServeEncoder(
        arg or DEFAULT_APP,
        timeout_s=float(os.environ.get(TIMEOUT_ENV, "30")),
        retries=int(os.environ.get(RETRIES_ENV, "1")),
    )
