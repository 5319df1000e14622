"""The gateway side of the Ray Serve encoder pool: ``RayServeEncoder`` (``--encoder ray:APP``).

It joins the cluster as a driver, calls the pool's ``EncoderReplica`` through a
deployment handle, and keeps the adapter protocol: one result per image, or
``Overloaded`` for the whole request. Concurrent requests of one gateway share a
call, because a Serve call costs milliseconds of routing and RPC whatever it
carries; a lost replica means a retry on another; a pool with no running replica
means 503 at once, seen by a status probe in a background thread.

It never imports the replica side (``ray.serve``): what both sides share is
``ray.contract``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from modalgate.encoder_adapter.batching import Overloaded
from modalgate.encoder_adapter.protocol import Encoded
from modalgate.encoder_adapter.ray.contract import (
    DEFAULT_APP,
    Batching,
    PoolReply,
    check_batching,
    connect,
    from_wire,
)
from modalgate.errors import ErrorCode, Violation
from modalgate.settings import RaySettings

__all__ = ["RayServeEncoder", "ray_encoder"]

logger = logging.getLogger("modalgate.encoder.ray")


class RayServeEncoder:
    """The pool as an adapter: ``encode`` sends the whole request to one replica, sharing
    the call with the requests that arrive within ``coalesce_ms`` (up to ``max_batch``
    images; 0 turns that off).

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
        coalesce_ms: float = 2.0,
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
        self.batching = check_batching(batching) if batching else None
        try:
            self._handle = serve.get_app_handle(app)
        except RayServeException as exc:
            raise LookupError(f"no Ray Serve application {app!r} on the cluster") from exc
        self.replicas: Counter[str] = Counter()  # requests answered, per replica
        self.retried = 0
        self.failed = 0
        self._coalescer = _Coalescer(self._send, max_batch, coalesce_ms / 1000)
        self._healthy = self._probe()
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch, name=f"modalgate-ray-{app}", daemon=True
        )
        self._monitor.start()

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def calls(self) -> int:
        """Calls made to the pool: fewer than requests when concurrent ones shared one."""
        return self._coalescer.calls

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        if not images:
            return []
        if not self._healthy:
            raise Overloaded(self.unavailable_retry_after_s)
        return await self._coalescer.submit(list(images))

    async def _send(self, payload: list[bytes]) -> list[Encoded]:
        """One call, retried on another replica when its replica is lost."""
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        deadline = time.monotonic() + self.timeout_s
        for attempt in range(self.retries + 1):
            try:
                reply = await self._call(payload, deadline)
            except Overloaded:
                raise
            except BackPressureError as exc:  # this gateway's queue for the pool is full
                raise Overloaded(exc.retry_after_s or 1.0) from None
            except DeploymentUnavailableError:  # the application failed to deploy
                raise Overloaded(self.unavailable_retry_after_s) from None
            except Exception as exc:
                if not _replica_lost(exc):  # a replica-side bug: retrying would repeat it
                    logger.exception("the encoder pool failed on a request")
                elif attempt < self.retries:
                    self.retried += 1
                    logger.warning("encoder replica lost mid-request (%s); retrying", _short(exc))
                    continue
                else:
                    logger.error("encoder replica lost mid-request (%s); giving up", _short(exc))
            else:
                return self._unpack(reply)
            break
        self.failed += 1
        return [Encoded(error=_failed()) for _ in payload]

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
        return [from_wire(result) for result in reply.results]

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self._healthy = self._probe()
            except SystemExit:  # Ray's own, from a call made while it shuts down here
                return

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


class _Coalescer:
    """Concurrent requests merged into one call: what arrives within ``wait_s`` of the
    first, or until ``max_images``; each caller gets its own slice back (or the call's
    Overloaded). A caller that went away keeps its slot: the others still need the call."""

    def __init__(
        self,
        send: Callable[[list[bytes]], Awaitable[list[Encoded]]],
        max_images: int,
        wait_s: float,
    ) -> None:
        self._send = send
        self._max = max_images
        self._wait = wait_s
        self._pending: list[tuple[list[bytes], asyncio.Future[list[Encoded]]]] = []
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0

    async def submit(self, images: list[bytes]) -> list[Encoded]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (a restarted server, tests): afresh
            self._pending, self._count, self._timer, self._loop = [], 0, None, loop
        future: asyncio.Future[list[Encoded]] = loop.create_future()
        self._pending.append((images, future))
        self._count += len(images)
        if self._count >= self._max or self._wait <= 0:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._wait, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending, self._count = self._pending, [], 0
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._tasks.add(task)  # a reference, or the task may be collected mid-way
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[list[bytes], asyncio.Future[list[Encoded]]]]) -> None:
        self.calls += 1
        try:
            results = await self._send([image for images, _ in batch for image in images])
        except Exception as exc:  # Overloaded: the whole call was refused
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        start = 0
        for images, future in batch:
            if not future.done():
                future.set_result(results[start : start + len(images)])
            start += len(images)


async def _awaited(response: Any) -> PoolReply:
    return await response


def _replica_lost(exc: BaseException) -> bool:
    """A replica process gone (killed, node lost) or unreachable: worth another replica.
    Ray may wrap the actor's death in a RayTaskError; its ``cause`` tells."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import ReplicaUnavailableError

    lost = (ActorDiedError, ActorUnavailableError, ReplicaUnavailableError)
    return isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost)


def _short(exc: BaseException) -> str:
    """Ray's actor-death text runs to a page; the log needs its first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _failed() -> Violation:
    return Violation(ErrorCode.ENCODER_ERROR, "the encoder failed on this image")


def ray_encoder(arg: str | None) -> RayServeEncoder:
    """Registry factory: ``ray:APP`` (default app ``modalgate-encoder``); the cluster address
    from ``MODALGATE_RAY_ADDRESS`` (default ``auto``); timeout, retries and the coalescing
    window from ``MODALGATE_RAY_TIMEOUT_S``, ``MODALGATE_RAY_RETRIES``,
    ``MODALGATE_RAY_COALESCE_MS``."""
    settings = RaySettings()
    return RayServeEncoder(
        arg or DEFAULT_APP,
        timeout_s=settings.timeout_s,
        retries=settings.retries,
        coalesce_ms=settings.coalesce_ms,
    )
