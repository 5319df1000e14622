"""M2: decode throughput (megapixels per second) of ``DecodePool`` with 1 and 2 workers.

Test media, all made with Pillow: 32 photo-like JPEGs, 1920x1080 at quality 90
(rotated colour gradients, a dozen flat shapes, a blur, then 10% random noise:
~0.5 MB each), and 16 RGBA PNGs of the same size (the same recipe at 6% noise,
with a rotated gradient as alpha, so decoding composites onto the background;
8 distinct images, each twice, since encoding a PNG takes a second).

Contenders, per format: ``decode_image`` called directly on the event-loop
thread, one image after another (the baseline), and ``DecodePool(workers=1)``
and ``DecodePool(workers=2)``, each given the whole batch at once with
``decode_many``. Rounds are interleaved: in each round every contender decodes
the batch once, in an order that cycles through all six permutations.
Throughput = pixels in the batch / wall time of the batch.

Ratio = 2-worker throughput / 1-worker throughput, per round, for JPEG.
Target: >= 1.5 (the machine has 2 cores and Pillow releases the GIL while it
decodes). The PNG ratio is reported alongside, not judged.

Before each round a free-core probe times ``hashlib.sha256`` (C code that releases
the GIL) in 2 threads against 1: about 2.0 when both cores are free, about 1.0
when another process holds one. On a shared machine read the 2-worker ratio
against it. With ``--breakdown`` (or when the target is missed) the script also
times each stage of ``decode_image`` in a worker thread, compares page faults on
the loop thread and in a worker, and times bare Pillow decodes in 2 threads vs 1.

Usage: .venv/bin/python benchmarks/m2_decode_throughput.py [--quick] [--breakdown]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import itertools
import os
import random
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from _common import machine_line, result_line, spread, table, time_call
from PIL import Image, ImageDraw, ImageFilter, ImageOps

from modalgate.media.decode import DecodeOptions, DecodePool, decode_image, to_rgb
from modalgate.media.pillow import is_truncated, open_image
from modalgate.media.sniff import sniff

NAME = "m2_decode_throughput"
TARGET = 1.5
WIDTH, HEIGHT = 1920, 1080
CONTENDERS = ("direct", "pool 1 worker", "pool 2 workers")
FREE_PROBE = 1.8  # a probe reading at or above this: both cores were free

# ---------------------------------------------------------------- the media


def photo_like(seed: int, noise: float, alpha: bool = False) -> Image.Image:
    """Gradients, flat shapes, a blur and random noise: compresses like a photo, not like noise."""
    rng = random.Random(seed)
    gradient = Image.linear_gradient("L")

    def rotated() -> Image.Image:
        angle = rng.uniform(0, 360)
        return gradient.rotate(angle, Image.Resampling.BILINEAR, fillcolor=128).resize(
            (WIDTH, HEIGHT), Image.Resampling.BILINEAR
        )

    image = Image.merge("RGB", [rotated() for _ in range(3)])
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(WIDTH), rng.randrange(HEIGHT)
        box = (x0, y0, x0 + rng.randrange(40, WIDTH // 3), y0 + rng.randrange(40, HEIGHT // 3))
        color = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    image = image.filter(ImageFilter.GaussianBlur(3))
    grain = Image.frombytes("RGB", (WIDTH, HEIGHT), rng.randbytes(WIDTH * HEIGHT * 3))
    image = Image.blend(image, grain, noise)
    if alpha:
        image.putalpha(rotated())
    return image


def make_jpegs(count: int) -> list[bytes]:
    out = []
    for seed in range(count):
        buffer = io.BytesIO()
        photo_like(seed, 0.10).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def make_pngs(count: int, distinct: int = 8) -> list[bytes]:
    unique = []
    for seed in range(min(count, distinct)):
        buffer = io.BytesIO()
        photo_like(1000 + seed, 0.06, alpha=True).save(buffer, "PNG")
        unique.append(buffer.getvalue())
    return [unique[i % len(unique)] for i in range(count)]


def check(batches: dict[str, list[bytes]], pools: Sequence[DecodePool]) -> None:
    """Every contender decodes every image to 1920x1080 RGB; the PNGs do have alpha."""
    assert Image.open(io.BytesIO(batches["PNG"][0])).mode == "RGBA"
    loop = asyncio.new_event_loop()
    try:
        for batch in batches.values():
            results = [decode_image(data) for data in batch[:2]]
            for pool in pools:
                results += loop.run_until_complete(pool.decode_many(batch))
            for image in results:
                assert isinstance(image, Image.Image), image
                assert image.mode == "RGB" and image.size == (WIDTH, HEIGHT), image
    finally:
        loop.close()


# ---------------------------------------------------------------- the benchmark


def run_rounds(
    loop: asyncio.AbstractEventLoop,
    batches: dict[str, list[bytes]],
    pools: dict[str, DecodePool],
    rounds: int,
    probe: FreeCoreProbe,
) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """Seconds per batch, ``times[format][contender]``, and the free-core probe, per round."""

    async def direct(batch: list[bytes]) -> None:
        for data in batch:  # on the event-loop thread, as a handler without a pool would
            decode_image(data)

    def runner(contender: str, batch: list[bytes]) -> Callable[[], object]:
        if contender == "direct":
            return lambda: loop.run_until_complete(direct(batch))
        pool = pools[contender]
        return lambda: loop.run_until_complete(pool.decode_many(batch))

    orders = list(itertools.permutations(CONTENDERS))
    times = {fmt: {c: [] for c in CONTENDERS} for fmt in batches}
    for batch in batches.values():  # warm-up: starts the pools' threads
        for contender in CONTENDERS:
            runner(contender, batch[:4])()
    probes = []
    for r in range(rounds):
        probes.append(probe())
        for fmt, batch in batches.items():
            for contender in orders[r % len(orders)]:
                fn = runner(contender, batch)
                start = time.perf_counter()
                fn()
                times[fmt][contender].append(time.perf_counter() - start)
    return times, probes


def report(
    batches: dict[str, list[bytes]], times: dict[str, dict[str, list[float]]], probes: list[float]
) -> dict[str, list[float]]:
    """Prints MP/s per format and contender, and the ratios; returns 2w/1w ratios per format."""
    rows = []
    scaling: dict[str, list[float]] = {}
    for fmt, per in times.items():
        megapixels = len(batches[fmt]) * WIDTH * HEIGHT / 1e6
        mps = {c: [megapixels / t for t in per[c]] for c in CONTENDERS}
        two_vs_one = [
            b / a for a, b in zip(mps["pool 1 worker"], mps["pool 2 workers"], strict=True)
        ]
        one_vs_direct = [a / d for d, a in zip(mps["direct"], mps["pool 1 worker"], strict=True)]
        scaling[fmt] = two_vs_one
        rows.append(
            (
                f"{fmt} ({len(batches[fmt])} x {WIDTH}x{HEIGHT})",
                *(statistics.median(mps[c]) for c in CONTENDERS),
                statistics.median(two_vs_one),
                spread(two_vs_one),
                statistics.median(one_vs_direct),
                spread(one_vs_direct),
            )
        )
    headers = (
        "format (batch)",
        "direct MP/s",
        "1 worker MP/s",
        "2 workers MP/s",
        "2w / 1w",
        "spread",
        "1w / direct",
        "spread",
    )
    print(table(headers, rows))
    print("MP/s: median over rounds; ratios: median of the per-round ratios (spread min..max)")
    per_round = [
        (r + 1, *(scaling[fmt][r] for fmt in scaling), probe) for r, probe in enumerate(probes)
    ]
    print("\nper round (probe: sha256 in 2 threads vs 1 just before the round; 2.0 = 2 free cores)")
    print(table(("round", *(f"{fmt} 2w / 1w" for fmt in scaling), "probe"), per_round))
    print(f"probe: median {statistics.median(probes):.2f} ({spread(probes)})")
    free = [r for r, probe in enumerate(probes) if probe >= FREE_PROBE]
    if free:
        medians = ", ".join(
            f"{fmt} {statistics.median(scaling[fmt][r] for r in free):.2f}" for fmt in scaling
        )
        print(
            f"2w / 1w in the {len(free)} of {len(probes)} rounds whose probe read "
            f">= {FREE_PROBE} (both cores free): {medians} (context, not the RESULT)"
        )
    return scaling


# ---------------------------------------------------------------- machine and diagnosis


class FreeCoreProbe:
    """2-thread / 1-thread throughput of ``hashlib.sha256`` (C code that releases the GIL).

    About 2.0 when both cores are free; about 1.0 when something else holds one of
    them, and then no 2-worker figure can scale either.
    """

    def __init__(self, megabytes: int = 16) -> None:
        self._buffer = os.urandom(megabytes << 20)
        self._one = ThreadPoolExecutor(1)
        self._two = ThreadPoolExecutor(2)
        self()

    def _work(self, _: int) -> None:
        hashlib.sha256(self._buffer).digest()

    def __call__(self) -> float:
        t1 = time_call(lambda: list(self._one.map(self._work, range(4))))
        t2 = time_call(lambda: list(self._two.map(self._work, range(4))))
        return t1 / t2

    def close(self) -> None:
        self._one.shutdown()
        self._two.shutdown()


def stage_breakdown(data: bytes, reps: int = 12) -> list[tuple[str, float, float]]:
    """Per stage of ``decode_image``, in a worker thread as the pool runs it.

    Median milliseconds per image, and minor page faults per image (each decode
    allocates its output afresh; on this VM a fault costs microseconds).
    """
    options = DecodeOptions()

    def one_decode() -> list[tuple[str, float, int]]:
        marks: list[tuple[str, float, int]] = []

        def mark(label: str) -> None:
            marks.append((label, time.perf_counter(), _faults()))

        mark("")
        sniffed = sniff(data[:64])
        assert sniffed is not None and not is_truncated(data, sniffed.format)
        image = open_image(data, sniffed.format)
        mark("sniff + is_truncated + open_image (header)")
        image.load()
        mark("image.load() (the pixel decode)")
        transposed = ImageOps.exif_transpose(image)
        mark("ImageOps.exif_transpose (no orientation tag)")
        rgb = to_rgb(transposed, options.background)
        mark("to_rgb")
        del image, transposed, rgb
        mark("freeing the images")
        return [
            (label, (t - t0) * 1e3, f - f0)
            for (_, t0, f0), (label, t, f) in itertools.pairwise(marks)
        ]

    with ThreadPoolExecutor(1) as worker:
        runs = [worker.submit(one_decode).result() for _ in range(reps + 1)][1:]
        total = [worker.submit(time_call, lambda: decode_image(data)).result() for _ in range(reps)]
    rows = [
        (label, statistics.median(r[i][1] for r in runs), statistics.median(r[i][2] for r in runs))
        for i, (label, _, _) in enumerate(runs[0])
    ]
    rows.append(("decode_image, whole", statistics.median(total) * 1e3, float("nan")))
    return rows


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def raw_pillow_scaling(batch: list[bytes], rounds: int = 3) -> float:
    """2-thread / 1-thread throughput of bare ``Image.open(...).load()`` (no modalgate)."""

    def decode(data: bytes) -> None:
        Image.open(io.BytesIO(data)).load()

    ratios = []
    with ThreadPoolExecutor(1) as one, ThreadPoolExecutor(2) as two:
        list(two.map(decode, batch[:4]))
        for _ in range(rounds):
            t1 = time_call(lambda: list(one.map(decode, batch)))
            t2 = time_call(lambda: list(two.map(decode, batch)))
            ratios.append(t1 / t2)
    return statistics.median(ratios)


def loop_vs_worker(data: bytes, reps: int = 8) -> str:
    """``decode_image`` on the main (loop) thread vs in a worker: ms and page faults per image."""

    def measure() -> tuple[float, float]:
        f0, t0 = _faults(), time.perf_counter()
        for _ in range(reps):
            decode_image(data)
        return (time.perf_counter() - t0) / reps * 1e3, (_faults() - f0) / reps

    measure()
    main_ms, main_faults = measure()
    with ThreadPoolExecutor(1) as worker:
        worker.submit(measure).result()
        thread_ms, thread_faults = worker.submit(measure).result()
    return (
        f"decode_image one image at a time: main thread {main_ms:.1f} ms, "
        f"{main_faults:.0f} page faults per image; worker thread {thread_ms:.1f} ms, "
        f"{thread_faults:.0f} faults"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~15 s)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--breakdown", action="store_true", help="where a decode's time goes")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)

    start = time.perf_counter()
    batches = {
        "JPEG": make_jpegs(8 if args.quick else 32),
        "PNG": make_pngs(4 if args.quick else 16, distinct=4 if args.quick else 8),
    }
    made = time.perf_counter() - start
    pools = {"pool 1 worker": DecodePool(workers=1), "pool 2 workers": DecodePool(workers=2)}
    probe = FreeCoreProbe()
    try:
        check(batches, list(pools.values()))
        print(f"== {NAME}")
        print(machine_line())
        for fmt, batch in batches.items():
            sizes = [len(b) for b in batch]
            kind = "photo-like q90, RGB" if fmt == "JPEG" else "photo-like, RGBA (alpha gradient)"
            print(
                f"{fmt}: {len(batch)} x {WIDTH}x{HEIGHT} {kind}, "
                f"{statistics.mean(sizes) / 1e6:.2f} MB each on average "
                f"({len(set(batch))} distinct)"
            )
        print(
            f"media made in {made:.1f} s; {rounds} rounds, each contender decodes each batch "
            "once per round, order cycling through all six permutations"
        )
        loop = asyncio.new_event_loop()
        try:
            start = time.perf_counter()
            times, probes = run_rounds(loop, batches, pools, rounds, probe)
            elapsed = time.perf_counter() - start
        finally:
            loop.close()
        scaling = report(batches, times, probes)
        print(f"measured in {elapsed:.1f} s")
        ratio = statistics.median(scaling["JPEG"])
        passed = ratio >= TARGET

        if args.breakdown or not passed:
            print("\nwhere a decode's time goes (a worker thread, median per image):")
            rows = []
            for fmt, batch in batches.items():
                rows += [(f"{fmt}: {label}", ms, n) for label, ms, n in stage_breakdown(batch[0])]
            print(table(("stage", "ms", "page faults"), rows))
            for fmt, batch in batches.items():
                print(f"{fmt}: {loop_vs_worker(batch[0])}")
                scaling_raw = raw_pillow_scaling(batch[:8])
                print(f"{fmt}: bare Image.open().load() in 2 threads vs 1: {scaling_raw:.2f}x")
    finally:
        for pool in pools.values():
            pool.close()
        probe.close()
    print(result_line(NAME, ratio, f">={TARGET:g}", passed))


if __name__ == "__main__":
    main()
