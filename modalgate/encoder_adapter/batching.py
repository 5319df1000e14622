"""Micro-batching in front of a model that runs in its own thread.

Requests wait in a bounded queue; a batch is cut when it holds ``max_items``
items, or ``max_cost`` worth of work (patches), or when its first item has
waited ``max_wait_ms``. The model function runs in one dedicated worker thread,
so the event loop never blocks on it and the model never runs twice at once.
A full queue is refused at once (``Overloaded``: the gateway answers 503 with
Retry-After) rather than letting latency grow without bound; a request whose
caller went away is dropped before it costs a forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger("modalgate.encoder")
Item = TypeVar("Item")
Result = TypeVar("Result")


class Overloaded(Exception):
    """The queue is full; ``retry_after_s`` is a hint for the client."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("the encoder queue is full")
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Pending(Generic[Item, Result]):
    item: Item
    cost: int
    future: asyncio.Future[Result]
    queued_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class BatchSettings:
    max_items: int = 16
    max_cost: int = 65536  # e.g. patches: what one forward pass can hold
    max_wait_ms: float = 5.0
    max_queue: int = 256
    timeout_s: float = 30.0


class MicroBatcher(Generic[Item, Result]):
    # Observer hook, e.g. metrics: (batch size, seconds of the forward pass), called on the
    # event loop after each batch. A plain attribute so this module needs no metrics library.
    on_batch: Callable[[int, float], None] | None = None

    def __init__(
        self,
        run_batch: Callable[[list[Item]], Sequence[Result | BaseException]],
        settings: BatchSettings | None = None,
        cost: Callable[[Item], int] = lambda item: 1,
    ) -> None:
        self._run_batch = run_batch
        self.settings = settings or BatchSettings()
        self._cost = cost
        self._queue: deque[_Pending[Item, Result]] = deque()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modalgate-model")
        self._batch_seconds = 0.05  # moving estimate of one forward pass, for Retry-After
        self.batches = 0
        self.items = 0

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def submit(self, item: Item) -> Result:
        """The model's result for ``item``; raises Overloaded, TimeoutError, or the item's error."""
        if len(self._queue) >= self.settings.max_queue:
            raise Overloaded(self.retry_after())
        loop = asyncio.get_running_loop()
        pending = _Pending(item, self._cost(item), loop.create_future())
        self._queue.append(pending)
        self._ensure_worker()
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            return await asyncio.wait_for(
                asyncio.shield(pending.future), timeout=self.settings.timeout_s
            )
        except (asyncio.CancelledError, TimeoutError):
            pending.future.cancel()  # still queued: dropped when the batch is cut
            raise

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for pending in self._queue:
            pending.future.cancel()
        self._queue.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work())

    async def _work(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._wait_for_batch()
            batch = self._cut_batch()
            if not batch:
                continue
            started = time.monotonic()
            try:
                results = await loop.run_in_executor(
                    self._executor, self._run_batch, [p.item for p in batch]
                )
            except Exception as exc:
                results = [exc] * len(batch)
            elapsed = time.monotonic() - started
            self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * elapsed
            self.batches += 1
            self.items += len(batch)
            if self.on_batch is not None:
                try:
                    self.on_batch(len(batch), elapsed)
                except Exception:  # an observer must never stop the worker
                    logger.exception("the on_batch observer failed")
            for pending, result in zip(batch, results, strict=True):
                if pending.future.done():
                    continue
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)

    async def _wait_for_batch(self) -> None:
        """Until the batch is full or its oldest item has waited max_wait_ms."""
        assert self._wakeup is not None
        settings = self.settings
        while True:
            live = [p for p in self._queue if not p.future.done()]
            cost = sum(p.cost for p in live)
            if len(live) >= settings.max_items or cost >= settings.max_cost or not live:
                return
            waited = time.monotonic() - live[0].queued_at
            remaining = settings.max_wait_ms / 1000 - waited
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _cut_batch(self) -> list[_Pending[Item, Result]]:
        batch: list[_Pending[Item, Result]] = []
        cost = 0
        while self._queue and len(batch) < self.settings.max_items:
            pending = self._queue[0]
            if pending.future.done():  # cancelled or timed out while queued
                self._queue.popleft()
                continue
            if batch and cost + pending.cost > self.settings.max_cost:
                break
            batch.append(self._queue.popleft())
            cost += pending.cost
        return batch

    def retry_after(self) -> float:
        """Seconds until the queue ahead has likely drained: a hint, at least one."""
        batches_queued = len(self._queue) / max(1, self.settings.max_items)
        return max(1.0, round(batches_queued * self._batch_seconds + 0.5))
