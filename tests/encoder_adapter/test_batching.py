"""The micro-batcher, the embedding cache and the adapter registry, without a model."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from modalgate.encoder_adapter import (
    BatchSettings,
    EmbeddingCache,
    MicroBatcher,
    Overloaded,
    available,
    create_encoder,
    register,
)
from modalgate.encoder_adapter.cache import content_key
from modalgate.encoder_adapter.registry import UnknownEncoder


def run(coroutine):
    return asyncio.run(coroutine)


class Recorder:
    """A batch function that records every batch it was given."""

    def __init__(self, gate: threading.Event | None = None, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.gate = gate
        self.fail_on = fail_on
        self.started = threading.Event()  # set when the model thread has taken a batch

    def __call__(self, items: list[int]) -> list[int | BaseException]:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(list(items))
        return [ValueError("bad item") if i == self.fail_on else i * 10 for i in items]


async def in_model_thread(recorder: Recorder) -> None:
    """Until the model thread has taken a batch (and is held at the recorder's gate)."""
    assert await asyncio.to_thread(recorder.started.wait, 10), "no batch reached the model"


async def until(condition, timeout: float = 10.0) -> None:
    """Until ``condition()`` holds: it changes on this event loop, so yield until it does."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0)  # a yield, not a wait: the condition changes on this loop


def test_results_land_on_their_requests_in_batches():
    recorder = Recorder()

    async def main():
        batcher = MicroBatcher(recorder, BatchSettings(max_items=8, max_wait_ms=20))
        results = await asyncio.gather(*(batcher.submit(i) for i in range(100)))
        await batcher.close()
        return results, batcher

    results, batcher = run(main())
    assert results == [i * 10 for i in range(100)]
    assert all(len(batch) <= 8 for batch in recorder.batches)
    assert len(recorder.batches) < 100  # they were batched
    assert sorted(i for batch in recorder.batches for i in batch) == list(range(100))
    assert (batcher.batches, batcher.items) == (len(recorder.batches), 100)


def test_batches_are_cut_by_cost():
    recorder = Recorder()

    async def main():
        batcher = MicroBatcher(
            recorder,
            BatchSettings(max_items=64, max_cost=10, max_wait_ms=20),
            cost=lambda item: item,
        )
        await asyncio.gather(*(batcher.submit(i) for i in (4, 4, 4, 9, 1)))
        await batcher.close()

    run(main())
    assert all(sum(batch) <= 10 or len(batch) == 1 for batch in recorder.batches)


def test_one_failing_item_fails_alone():
    recorder = Recorder(fail_on=3)

    async def main():
        batcher = MicroBatcher(recorder, BatchSettings(max_wait_ms=20))
        results = await asyncio.gather(
            *(batcher.submit(i) for i in range(6)), return_exceptions=True
        )
        await batcher.close()
        return results

    results = run(main())
    assert isinstance(results[3], ValueError)
    assert [r for i, r in enumerate(results) if i != 3] == [0, 10, 20, 40, 50]


def test_full_queue_is_refused_with_a_retry_hint():
    gate = threading.Event()
    recorder = Recorder(gate)

    async def main():
        batcher = MicroBatcher(recorder, BatchSettings(max_items=1, max_queue=3, max_wait_ms=0))
        first = asyncio.ensure_future(batcher.submit(0))
        await in_model_thread(recorder)  # the first item is now in the model thread
        queued = [asyncio.ensure_future(batcher.submit(i)) for i in (1, 2, 3)]
        await until(lambda: batcher.queue_depth == 3)
        with pytest.raises(Overloaded) as caught:
            await batcher.submit(4)
        gate.set()
        results = await asyncio.gather(first, *queued)
        await batcher.close()
        return caught.value, results

    refusal, results = run(main())
    assert refusal.retry_after_s >= 1
    assert results == [0, 10, 20, 30]


def test_a_cancelled_request_never_reaches_the_model():
    gate = threading.Event()
    recorder = Recorder(gate)

    async def main():
        batcher = MicroBatcher(recorder, BatchSettings(max_items=1, max_wait_ms=0))
        first = asyncio.ensure_future(batcher.submit(1))
        await in_model_thread(recorder)
        abandoned = asyncio.ensure_future(batcher.submit(2))
        kept = asyncio.ensure_future(batcher.submit(3))
        await until(lambda: batcher.queue_depth == 2)
        abandoned.cancel()  # the client went away while queued
        await asyncio.wait([abandoned], timeout=10)  # cancellation lands at the task's next step
        assert abandoned.cancelled()
        gate.set()
        results = await asyncio.gather(first, kept)
        await batcher.close()
        return results

    assert run(main()) == [10, 30]
    assert [i for batch in recorder.batches for i in batch] == [1, 3]


def test_per_request_timeout():
    gate = threading.Event()

    async def main():
        batcher = MicroBatcher(Recorder(gate), BatchSettings(timeout_s=0.1, max_wait_ms=0))
        with pytest.raises(TimeoutError):
            await batcher.submit(1)
        gate.set()
        await batcher.close()

    run(main())


def test_the_event_loop_keeps_running_while_the_model_works():
    """The model finishes only once the event loop has answered it: were the model run on
    the loop's thread, the loop could not answer and the model would give up."""
    model_started, loop_answered = threading.Event(), threading.Event()

    def model(items):
        model_started.set()
        if not loop_answered.wait(10):
            raise RuntimeError("the event loop was blocked while the model ran")
        return items

    async def main():
        batcher = MicroBatcher(model, BatchSettings(max_wait_ms=0))
        request = asyncio.ensure_future(batcher.submit(1))
        assert await asyncio.to_thread(model_started.wait, 10), "no batch reached the model"
        loop_answered.set()  # this line runs on the loop, while the model waits for it
        result = await request
        await batcher.close()
        return result

    assert run(main()) == 1


def test_cache_is_lru_and_bounded_in_bytes():
    cache = EmbeddingCache(max_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("c", "C", 40)  # evicts b, the least recent
    assert cache.get("b") is None
    assert (cache.get("a"), cache.get("c")) == ("A", "C")
    assert cache.size_bytes == 80 and len(cache) == 2
    cache.put("huge", "H", 1000)  # larger than the whole cache: not kept
    assert cache.get("huge") is None
    assert (cache.hits, cache.misses) == (3, 2)


def test_content_key_covers_bytes_and_settings():
    assert content_key(b"x", "p14") == content_key(b"x", "p14")
    assert content_key(b"x", "p14") != content_key(b"y", "p14")
    assert content_key(b"x", "p14") != content_key(b"x", "p16")


def test_registry_by_name_and_unknown_names():
    class Adapter:
        name = "echo"
        modalities = frozenset({"image"})
        max_batch = 1

        def __init__(self, arg):
            self.arg = arg

    register("echo-test", Adapter)
    assert create_encoder("echo-test:/some/dir").arg == "/some/dir"
    assert create_encoder("echo-test").arg is None
    with pytest.raises(UnknownEncoder, match="echo-test"):
        create_encoder("nope:1")
    assert "kimi" in available()


def test_registry_finds_third_party_entry_points(tmp_path, monkeypatch):
    """A package installed beside modalgate adds an adapter through its entry points."""
    package = tmp_path / "thirdparty_encoders.py"
    package.write_text(
        "class Pool:\n"
        "    name = 'pool'\n"
        "    modalities = frozenset({'image'})\n"
        "    max_batch = 4\n"
        "    def __init__(self, arg):\n"
        "        self.arg = arg\n"
        "def make(arg):\n"
        "    return Pool(arg)\n"
    )
    info = tmp_path / "thirdparty_encoders-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-encoders\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[modalgate.encoders]\npool = thirdparty_encoders:make\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "pool" in available()
    adapter = create_encoder("pool:cluster-a")
    assert (adapter.name, adapter.arg) == ("pool", "cluster-a")
    monkeypatch.delitem(sys.modules, "thirdparty_encoders", raising=False)
