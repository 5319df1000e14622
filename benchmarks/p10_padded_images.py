"""P10: a real image padded with empty container entries costs about what a real image does.

Each padded image is a real 32x32 Pillow image with ~1 MB of the emptiest entries
its format allows spliced in (``tests/media_stubs.padded_images``: 4-byte JPEG
comment segments, fill or stray bytes, empty PNG chunks, one-byte GIF
sub-blocks, empty RIFF chunks). Each is probed as the gate probes an image
(``probe_image``: the container walk, then Pillow's header read) and must be
refused; beside it, a real photo-like image of the same format, about as big, is
probed and must pass. Both are timed in the same run, best of ``--reps``.

Part 1. Ratio = the padded image's ms per MB / the real image's ms per MB, per
format; the RESULT line takes the worst. Target: <= 20 (the cheapest real probe,
a baseline JPEG's, is one ``rfind`` over its scan: ~0.05 ms per MB). Before the
walks counted entries against a budget (``media/walk_budget.py``), a padded
megabyte cost 74 ms (WebP) to 1.5 s (JPEG fill bytes): 10^2 to 10^4 times a real
image.

Part 2. The budget's floor is per image, and a request carries up to
``max_images`` (16 built in, 500 for some rules): ``validate_body`` on a request of
16 images each padded with as many entries as its walk accepts (the most work an
accepted image can cost; found by bisection) against 16 real 32x32 images of the
same format. Ratio = padded ms / real ms, worst format. Target: <= 10.

Usage: .venv/bin/python benchmarks/p10_padded_images.py [--quick] [--reps N] [--mb N]
       [--images N]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import best, data_url, machine_line, result_line, table
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from media_stubs import (
    gif_with_sub_blocks,
    jpeg_with,
    padded_images,
    png_with_chunks,
    webp_with_chunks,
)
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import validate_body
from modalgate.validators.image_probe import ImageProbeError, probe_image

NAME = "p10_padded_images"
TARGET = 20.0
REQUEST_TARGET = 10.0
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
    return best(function, reps) * 1e3


def probe(data: bytes, fmt: str) -> str:
    try:
        probe_image(data, fmt, 1, MAX_PIXELS)
    except ImageProbeError as exc:
        return f"refused: {exc}"
    return "passed"


def per_megabyte(size: int, reps: int) -> float:
    """Part 1: the worst ratio of a padded megabyte's probe to a real image's, per MB."""
    padded = padded_images(size)
    reals = {fmt: real_image(fmt, size) for fmt in sorted({fmt for fmt, _ in padded.values()})}
    real_cost = {}
    rows = []
    for fmt, data in reals.items():
        assert probe(data, fmt) == "passed", fmt
        ms = best_ms(lambda d=data, f=fmt: probe_image(d, f, 1, MAX_PIXELS), reps)
        real_cost[fmt] = ms / (len(data) / 1e6)
        rows.append([f"real {fmt}", f"{len(data) / 1e6:.2f}", f"{ms:.2f}", f"{real_cost[fmt]:.2f}"])
        rows[-1] += ["", "passed"]
    worst = 0.0
    for name, (fmt, data) in padded.items():
        outcome = probe(data, fmt)
        assert outcome.startswith("refused"), (name, outcome)
        ms = best_ms(lambda d=data, f=fmt: probe(d, f), reps)
        per_mb = ms / (len(data) / 1e6)
        ratio = per_mb / real_cost[fmt]
        worst = max(worst, ratio)
        rows.append([name, f"{len(data) / 1e6:.2f}", f"{ms:.2f}", f"{per_mb:.2f}", f"{ratio:.1f}"])
        rows[-1].append(outcome[:60])
    print(table(["image", "MB", "probe ms", "ms per MB", "ratio", "outcome"], rows))
    return worst


PADDERS: dict[str, tuple[str, Callable[[int], bytes]]] = {
    "jpeg comment segments": ("jpeg", lambda n: jpeg_with(b"\xff\xfe\x00\x02" * n)),
    "png empty chunks": ("png", png_with_chunks),
    "gif one-byte sub-blocks": ("gif", gif_with_sub_blocks),
    "webp empty chunks": ("webp", webp_with_chunks),
}


def at_the_limit(fmt: str, pad: Callable[[int], bytes]) -> bytes:
    """The image padded with as many entries as its walk still accepts."""
    count = 1
    while probe(pad(count * 2), fmt) == "passed":
        count *= 2
    low, high = count, count * 2  # passes at low, refused at high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if probe(pad(middle), fmt) == "passed" else (low, middle)
    return pad(low)


def request(images: list[tuple[str, bytes]]) -> bytes:
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(data, f"image/{fmt}")}}
        for fmt, data in images
    ]
    return json.dumps(
        {"model": "kimi-k3", "messages": [{"role": "user", "content": parts}]}
    ).encode()


def per_request(count: int, reps: int) -> float:
    """Part 2: the worst ratio of a request of ``count`` images padded to their walks'
    limit (accepted: the most work an image can cost) to one of real small images."""
    matcher = RuleMatcher(load_policy(None))
    rows, worst = [], 0.0
    for name, (fmt, pad) in PADDERS.items():
        padded, real = (
            request([(fmt, at_the_limit(fmt, pad))] * count),
            request([(fmt, pad(0))] * count),
        )
        for body in (padded, real):
            assert validate_body(body, matcher).accepted, name
        padded_ms = best_ms(lambda b=padded: validate_body(b, matcher), reps)
        real_ms = best_ms(lambda b=real: validate_body(b, matcher), reps)
        worst = max(worst, padded_ms / real_ms)
        rows.append([name, f"{len(padded) / 1e3:.0f}", f"{padded_ms:.2f}", f"{real_ms:.2f}"])
        rows[-1].append(f"{padded_ms / real_ms:.1f}")
    print(table(["images padded to the limit", "KB", "padded ms", "real ms", "ratio"], rows))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~10 s)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--mb", type=float, default=1.0, help="padding per image, in MB")
    parser.add_argument("--images", type=int, default=16, help="images per request (part 2)")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 15)
    size = int(args.mb * (1 << 20))
    print(f"== {NAME}")
    print(machine_line())
    print(f"part 1: images padded with ~{size} bytes of empty entries against real images of")
    print(f"about that size, probed (walk and header); best of {reps}")
    worst = per_megabyte(size, reps)
    print(result_line(NAME, worst, f"<={TARGET:g}", worst <= TARGET))
    print(f"\npart 2: validate_body of a request of {args.images} images each padded to its")
    print(f"walk's limit, against {args.images} real 32x32 images; best of {reps}")
    worst = per_request(args.images, reps)
    print(result_line(NAME + "_request", worst, f"<={REQUEST_TARGET:g}", worst <= REQUEST_TARGET))


if __name__ == "__main__":
    main()
