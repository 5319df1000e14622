"""Worker threads for the gate's CPU work on big bodies, handed over at little cost.

A big body is validated off the event loop (``ModalGate.run_cpu``), so other
requests go on while it is parsed and its images decoded. ``anyio.to_thread``
did the hand-over in ~80-95 us of CPU per call on this project's 2-core machine
(a capacity limiter, a ``queue.Queue`` on a ``threading.Condition``, cancel
scopes); a C ``SimpleQueue`` and one ``call_soon_threadsafe`` do it in ~30 us
(``benchmarks/p7_proxies.py``'s image body: about a tenth of the gateway's CPU).

Threads start as work comes, up to ``limit``, and end after ``IDLE_EXIT_S`` without
work. A caller cancelled while its work waits or runs gets ``CancelledError`` at
once: work not yet started is skipped, work already running finishes in its thread
and its result is dropped. Outside asyncio (trio, through anyio) the work goes to
``anyio.to_thread`` as before.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import suppress
from queue import Empty, SimpleQueue
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")
IDLE_EXIT_S = 10.0  # as anyio's idle workers
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class CpuThreads:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("at least one thread")
        self.limit = limit
        self._jobs: SimpleQueue[_Job] = SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # started and not ended
        self._idle = 0  # waiting for a job
        self._queued = 0  # put and not yet taken
        self._anyio_limiter: anyio.CapacityLimiter | None = None

    @property
    def threads(self) -> int:
        return self._threads

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` in one of the threads; its result or its exception."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return await self._run_elsewhere(function, args)
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, function, args))
        with self._lock:
            self._queued += 1
            start = self._queued > self._idle and self._threads < self.limit
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name="modalgate-cpu", daemon=True).start()
        return await future

    async def _run_elsewhere(self, function: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._anyio_limiter is None:
            self._anyio_limiter = anyio.CapacityLimiter(self.limit)
        return await anyio.to_thread.run_sync(function, *args, limiter=self._anyio_limiter)

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = jobs.get(timeout=IDLE_EXIT_S)
            except Empty:
                with self._lock:
                    self._idle -= 1
                    if self._queued <= 0:  # else a job came as the wait ended: take it
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            _run(job)
            del job  # no body kept alive while idle


def _run(job: _Job) -> None:
    loop, future, function, args = job
    if future.cancelled():
        return
    try:
        result, error = function(*args), None
    except BaseException as exc:  # the caller's to handle, on its loop
        result, error = None, exc
    with suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
