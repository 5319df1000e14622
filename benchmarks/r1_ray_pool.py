"""R1: the encoder pool on Ray Serve (CPU, tiny Kimi tower): the hop, scaling, batching.

One local Ray instance, pools deployed side by side, every ratio from interleaved
rounds in this one run (see ``_common.py``):

* hop: the local Kimi adapter in this process vs a 1-replica pool, the same burst
  of concurrent one-image requests. ratio = pool time / local time (the price of
  the Ray hop: routing, pickling images out and embeddings back). Both sides get
  one torch thread and two decode threads, and neither a cache hit.
* scale: a 2-replica pool vs the 1-replica pool on a bigger burst. ratio = 2-replica
  throughput / 1-replica throughput (this 2-core machine also runs the caller).
* coalesce: the 2-replica pool, the gateway adapter sharing one Serve call among
  concurrent requests (the default, 2 ms window) vs one call per request.
  ratio = one-call-per-request time / coalesced time.
* batching: the 2-replica pool, one call per request, Ray Serve's ``@serve.batch``
  merging requests before the adapter vs modalgate's micro-batcher alone (the same
  replicas, chosen per request). ratio = @serve.batch time / modalgate time.

Ray is told of 3 CPUs so that 1 + 2 replicas (num_cpus=1 each: Ray then sets one
OpenMP thread per replica) can all be deployed; idle replicas cost nothing, and
each contender runs alone in its turn. Every request's images are distinct bytes
(a tEXt chunk with a counter), so no cache anywhere serves a repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from itertools import count
from pathlib import Path

import numpy as np
from _common import interleaved, machine_line, print_rounds, result_line
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kimi_tiny import save_full_checkpoint
from modalgate.encoder_adapter.kimi.adapter import KimiEncoderAdapter
from modalgate.encoder_adapter.ray.client import RayServeEncoder
from modalgate.encoder_adapter.ray.serve import PoolConfig, build_app

NAME = "r1_ray_pool"
TARGETS = {"hop": 1.5, "scale": 1.3, "batching": 1.0}  # hop <=, scale >=, batching: report


class Images:
    """Distinct PNG bytes from a few noise images, without re-encoding each one."""

    def __init__(self, side: int) -> None:
        rng = np.random.default_rng(0)
        self._bases = []
        for i in range(8):
            pixels = rng.integers(0, 256, (side + i % 3, side, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, "PNG")
            self._bases.append(buffer.getvalue())
        self._serial = count()

    def take(self, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            serial = next(self._serial)
            base = self._bases[serial % len(self._bases)]
            text = b"n\x00%d" % serial
            chunk = struct.pack(">I", len(text)) + b"tEXt" + text
            chunk += struct.pack(">I", zlib.crc32(b"tEXt" + text))
            out.append(base[:-12] + chunk + base[-12:])  # before IEND (its last 12 bytes)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--side", type=int, default=112, help="image side in pixels")
    parser.add_argument("--hop-burst", type=int, default=16, help="requests per hop burst")
    parser.add_argument("--burst", type=int, default=64, help="requests per scale burst")
    args = parser.parse_args()
    rounds, reps = (3, 1) if args.quick else (9, 3)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch
    from ray import serve

    print(f"== {NAME}")
    print(machine_line())
    torch.set_num_threads(1)  # the local contender gets what one replica gets
    loop = asyncio.new_event_loop()
    images = Images(args.side)
    with tempfile.TemporaryDirectory() as directory:
        save_full_checkpoint(Path(directory))
        started = time.perf_counter()
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        spec = f"kimi:{directory}"
        serve.run_many(  # side by side: their replicas start together
            [
                serve.RunTarget(
                    target=build_app(PoolConfig(spec, num_replicas=n)), name=name, route_prefix=None
                )
                for name, n in (("r1-one", 1), ("r1-two", 2))
            ]
        )
        print(f"ray + 3 replicas up in {time.perf_counter() - started:.1f} s")
        local = KimiEncoderAdapter(directory, device="cpu", cache_bytes=0)
        one = RayServeEncoder("r1-one")
        two = RayServeEncoder("r1-two")
        two_plain = RayServeEncoder("r1-two", coalesce_ms=0)
        two_serve = RayServeEncoder("r1-two", batching="serve", coalesce_ms=0)
        adapters = (local, one, two, two_plain, two_serve)

        def burst(adapter, n: int) -> Callable[[], None]:
            def go() -> None:
                async def all_at_once() -> None:
                    batch = images.take(n)
                    results = await asyncio.gather(*(adapter.encode([i]) for i in batch))
                    assert all(r[0].error is None for r in results)

                loop.run_until_complete(all_at_once())

            return go

        for adapter in adapters:  # warm-up: routing, first forwards
            burst(adapter, args.burst)()
        print(
            f"tiny Kimi-K2.5 tower on the CPU, {args.side}px PNGs; {rounds} rounds x {reps} "
            f"bursts, interleaved; per round the median of each"
        )
        ratios = {}

        def compare(title: str, a: tuple[str, object], b: tuple[str, object], n: int, ratio):
            """One side-by-side comparison: interleaved bursts of ``n``, printed."""
            print(f"\n-- {title}")
            start = time.perf_counter()
            result = interleaved(burst(a[1], n), burst(b[1], n), rounds, reps, ratio=ratio)
            print_rounds(result, a[0], b[0], time.perf_counter() - start)
            return result

        hop = compare(
            f"hop: {args.hop_burst} concurrent one-image requests, local vs 1 replica",
            ("local", local),
            ("1 replica", one),
            args.hop_burst,
            lambda local_s, pool_s: pool_s / local_s,
        )
        ratios["hop"] = hop.ratio

        scale = compare(
            f"scale: {args.burst} concurrent one-image requests, 1 vs 2 replicas",
            ("1 replica", one),
            ("2 replicas", two),
            args.burst,
            lambda one_s, two_s: one_s / two_s,
        )
        for label, seconds in (("1 replica", scale.a), ("2 replicas", scale.b)):
            rate = args.burst / float(np.median(seconds))
            print(f"{label}: {rate:.0f} images/s ({rate / int(label[0]):.0f} per replica)")
        ratios["scale"] = scale.ratio

        coalesce = compare(
            f"coalesce: {args.burst} requests on 2 replicas, one call each vs shared",
            ("one call each", two_plain),
            ("coalesced", two),
            args.burst,
            lambda plain_s, shared_s: plain_s / shared_s,
        )
        ratios["coalesce"] = coalesce.ratio

        batching = compare(
            f"batching: {args.burst} requests on 2 replicas, modalgate vs @serve.batch",
            ("modalgate", two_plain),
            ("@serve.batch", two_serve),
            args.burst,
            lambda modalgate_s, serve_s: serve_s / modalgate_s,
        )
        for label, adapter in (
            ("modalgate", two_plain),
            ("@serve.batch", two_serve),
            ("coalesced + modalgate", two),
        ):
            before = loop.run_until_complete(two.info())
            burst(adapter, args.burst)()
            after = loop.run_until_complete(two.info())
            print(f"{label}: {_batches(before, after)}")
        ratios["batching"] = batching.ratio

        for adapter in adapters:
            loop.run_until_complete(adapter.close())
        ray.shutdown()
    loop.close()
    print()
    print(result_line(f"{NAME}_hop", ratios["hop"], f"<={TARGETS['hop']}", ratios["hop"] <= 1.5))
    print(
        result_line(
            f"{NAME}_scale", ratios["scale"], f">={TARGETS['scale']}", ratios["scale"] >= 1.3
        )
    )
    print(result_line(f"{NAME}_coalesce", ratios["coalesce"], "report", True))
    print(result_line(f"{NAME}_batching", ratios["batching"], "report", True))


def _batches(before: list[dict], after: list[dict]) -> str:
    """One burst as the replicas counted it: adapter calls and forward passes."""
    was = {i["replica"]: i for i in before}

    def delta(key: str) -> int:
        return sum((i[key] or 0) - (was[i["replica"]][key] or 0) for i in after)

    images, calls, passes = delta("images"), delta("calls"), delta("batches")
    return (
        f"{images} images, {calls} adapter calls, {passes} forward passes "
        f"({images / max(1, passes):.1f} images per pass)"
    )


if __name__ == "__main__":
    main()
