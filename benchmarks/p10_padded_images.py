"""P10: a real image padded with empty container entries costs about what a real image does.

Each padded image is a real 32x32 Pillow image with ~1 MB of the emptiest entries
its format allows spliced in (``tests/media_stubs.padded_images``: 4-byte JPEG
comment segments, fill or stray bytes, empty PNG chunks, one-byte GIF
sub-blocks, empty RIFF chunks). Each is probed as the gate probes an image
(``probe_image``: the container walk, then Pillow's header read) and must be
refused; beside it, a real photo-like image of the same format, about as big, is
probed and must pass. Both are timed in the same run, best of ``--reps``.

Ratio = the padded image's ms per MB / the real image's ms per MB, per format; the
RESULT line takes the worst. Target: <= 50 (the cheapest real probe, a baseline
JPEG's, is one ``rfind`` over its scan: ~0.05 ms per MB). Before the walks counted
entries against a budget (``media/walk_budget.py``), a padded megabyte cost 74 ms
(WebP) to 1.5 s (JPEG fill bytes): 10^2 to 10^4 times a real image.

Usage: .venv/bin/python benchmarks/p10_padded_images.py [--quick] [--reps N] [--mb N]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import machine_line, result_line, table
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from media_stubs import padded_images
from modalgate.validators.image_probe import ImageProbeError, probe_image

NAME = "p10_padded_images"
TARGET = 50.0
MAX_PIXELS = 50_000_000


def real_image(fmt: str, size: int) -> bytes:
    """A photo-like image of about ``size`` bytes (noise with a few levels compresses to
    roughly a JPEG or PNG of a photo)."""
    side = 256
    while True:
        rng = np.random.default_rng(side)
        pixels = (rng.integers(0, 8, (side, side, 3), dtype=np.uint8) * 32).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(
            buffer, fmt.upper(), **({"quality": 90} if fmt == "jpeg" else {})
        )
        if buffer.tell() >= size or side >= 4096:
            return buffer.getvalue()
        side = int(side * 1.4)


def best_ms(function: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def probe(data: bytes, fmt: str) -> str:
    try:
        probe_image(data, fmt, 1, MAX_PIXELS)
    except ImageProbeError as exc:
        return f"refused: {exc}"
    return "passed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~5 s)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--mb", type=float, default=1.0, help="padding per image, in MB")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 15)
    size = int(args.mb * (1 << 20))
    print(f"== {NAME}")
    print(machine_line())
    print(f"padded images of ~{size} bytes against real images of about that size; best of {reps}")
    padded = padded_images(size)
    reals = {fmt: real_image(fmt, size) for fmt in sorted({fmt for fmt, _ in padded.values()})}
    real_cost = {}
    rows = []
    for fmt, data in reals.items():
        assert probe(data, fmt) == "passed", fmt
        ms = best_ms(lambda d=data, f=fmt: probe_image(d, f, 1, MAX_PIXELS), reps)
        real_cost[fmt] = ms / (len(data) / 1e6)
        rows.append(
            [
                f"real {fmt}",
                f"{len(data) / 1e6:.2f}",
                f"{ms:.2f}",
                f"{real_cost[fmt]:.2f}",
                "",
                "passed",
            ]
        )
    worst = 0.0
    for name, (fmt, data) in padded.items():
        outcome = probe(data, fmt)
        assert outcome.startswith("refused"), (name, outcome)
        ms = best_ms(lambda d=data, f=fmt: probe(d, f), reps)
        per_mb = ms / (len(data) / 1e6)
        ratio = per_mb / real_cost[fmt]
        worst = max(worst, ratio)
        rows.append(
            [
                name,
                f"{len(data) / 1e6:.2f}",
                f"{ms:.2f}",
                f"{per_mb:.2f}",
                f"{ratio:.1f}",
                outcome[:60],
            ]
        )
    print(table(["image", "MB", "probe ms", "ms per MB", "ratio", "outcome"], rows))
    print(result_line(NAME, worst, f"<={TARGET}", worst <= TARGET))


if __name__ == "__main__":
    main()
