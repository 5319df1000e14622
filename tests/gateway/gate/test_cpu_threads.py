"""The gate's worker threads: results and errors come back, no more than ``limit`` run at
once, a cancelled caller is let go at once, idle threads end, and outside asyncio (trio)
the work still runs in a thread."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from modalgate.gateway.gate import cpu_threads
from modalgate.gateway.gate.cpu_threads import CpuThreads

WAIT_S = 10


def test_the_result_comes_back_from_another_thread() -> None:
    async def main() -> tuple[int, int]:
        threads = CpuThreads(2)
        return await threads.run(lambda a, b: (a + b, threading.get_ident()), 2, 3)

    total, where = asyncio.run(main())
    assert total == 5 and where != threading.get_ident()


def test_an_exception_is_raised_in_the_caller() -> None:
    def refuse(text: str) -> None:
        raise ValueError(text)

    async def main() -> None:
        with pytest.raises(ValueError, match=r"^no$"):
            await CpuThreads(1).run(refuse, "no")

    asyncio.run(main())


def test_no_more_than_limit_threads_run_at_once() -> None:
    running = 0
    most = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1

    threads = CpuThreads(3)

    async def main() -> None:
        await asyncio.gather(*(threads.run(work) for _ in range(12)))

    asyncio.run(main())
    assert most == 3 and threads.threads == 3


def test_a_cancelled_caller_is_let_go_and_its_queued_work_skipped() -> None:
    release = threading.Event()
    ran: list[str] = []
    threads = CpuThreads(1)

    def block(name: str) -> str:
        ran.append(name)
        release.wait(WAIT_S)
        return name

    async def main() -> str:
        first = asyncio.ensure_future(threads.run(block, "first"))
        queued = asyncio.ensure_future(threads.run(block, "queued"))
        await asyncio.sleep(0.05)
        first.cancel()
        queued.cancel()
        for task in (first, queued):
            with pytest.raises(asyncio.CancelledError):
                await task
        release.set()  # the running one finishes; its result is dropped
        return await threads.run(block, "after")  # the thread serves on

    assert asyncio.run(main()) == "after"
    assert ran == ["first", "after"]


def test_idle_threads_end_and_new_work_starts_one(monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "IDLE_EXIT_S", 0.05)
    threads = CpuThreads(2)

    async def main() -> None:
        await asyncio.gather(threads.run(time.sleep, 0.02), threads.run(time.sleep, 0.02))
        assert threads.threads == 2
        deadline = time.monotonic() + WAIT_S
        while threads.threads and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert threads.threads == 0
        assert await threads.run(lambda: "again") == "again"

    asyncio.run(main())


def test_work_finishing_after_its_loop_closed_does_not_end_the_thread() -> None:
    release = threading.Event()
    threads = CpuThreads(1)

    async def leave_early() -> None:
        pending = asyncio.ensure_future(threads.run(release.wait, WAIT_S))
        await asyncio.sleep(0.05)
        assert not pending.done()  # asyncio.run cancels it, and closes the loop

    asyncio.run(leave_early())  # the loop closes with the work still running
    release.set()

    async def main() -> str:
        return await asyncio.wait_for(threads.run(lambda: "served"), WAIT_S)

    assert asyncio.run(main()) == "served"
    assert threads.threads == 1


def test_outside_asyncio_the_work_runs_in_a_thread_too() -> None:
    threads = CpuThreads(1)

    async def main() -> int:
        return await threads.run(threading.get_ident)

    where = anyio.run(main, backend="trio")
    assert where != threading.get_ident()
