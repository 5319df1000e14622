"""P8: no request waits for another's image checks; what each check costs per image.

Part 1 (stall). A worker thread validates a large many-frame GIF request over and
over (as ``ModalGate.run_cpu`` does for bodies >= 256 KiB) while this thread, the
event loop's stand-in, validates a small one-PNG request (< 256 KiB: inline on the
loop) every few milliseconds. Reported: the small request's latency alone, under
that load with today's checks (stills policy: counting stops at frame 2; animated
policy: every frame's block chain is walked), and under the same load with the
previous probe (a process-wide lock around Pillow, whose ``n_frames`` decodes every
GIF frame), re-created here for the comparison.

Ratio = p50 latency under load (stills policy) / p50 alone. Target: <= 3, where the
remaining cost is CPython's GIL hand-over (``sys.getswitchinterval()``, 5 ms), not a
lock: the previous probe's ratio is in the thousands.

Part 2 (cost). Per image: Pillow's header read, the structural walk
(``check_structure``), and the full decode of ``verify_image_data``, in ms and per
MB / per megapixel, with the ratio of the decode to the default (header + walk).

Usage: .venv/bin/python benchmarks/p8_image_checks.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import numpy as np
from _common import best, data_url, machine_line, result_line, table
from PIL import Image

from modalgate.media.decode import decode_image, verify_image_data
from modalgate.media.image_integrity import check_structure
from modalgate.media.pillow import open_image
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.validators import media_checks, validate_body
from modalgate.validators.image_probe import ImageFacts

NAME = "p8_image_checks"
TARGET = 3.0


def noise(width: int, height: int, seed: int = 0, levels: int = 256) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, levels, (height, width, 3), dtype=np.uint8) * (256 // levels)
    return Image.fromarray(pixels.astype(np.uint8))


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def many_frame_gif(frames: int, side: int) -> bytes:
    """A real animated GIF made by Pillow: noise frames (photo-like data per frame)."""
    images = [noise(side, side, seed=i, levels=4).convert("L") for i in range(frames)]
    return encode(images[0], "GIF", save_all=True, append_images=images[1:], duration=40)


def tiny_frame_gif(frames: int) -> bytes:
    """Pillow's 8x8 one-frame GIF with its image block repeated: many frames, few bytes.

    Frame count, not pixels, is what made the previous probe slow: Pillow's
    ``n_frames`` seeks frame by frame in Python (about 5 us a frame).
    """
    one = encode(Image.new("L", (8, 8), 0), "GIF")
    block = one[one.rfind(b"\x2c\x00\x00\x00\x00\x08\x00\x08\x00") : -1]
    return one[:-1] + block * (frames - 1) + b";"


def request(data: bytes, mime: str) -> bytes:
    import orjson

    url = data_url(data, mime)
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return orjson.dumps({"model": "kimi-k3", "messages": [{"role": "user", "content": content}]})


# ---------------------------------------------------------------- the previous probe

_LEGACY_LOCK = threading.Lock()


def legacy_probe(data: bytes, fmt: str, *_: object) -> ImageFacts:
    """The probe as it was: one lock for every header read, and Pillow's frame count."""
    with _LEGACY_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image = open_image(data, fmt)
        frames = int(getattr(image, "n_frames", 1) or 1)
    return ImageFacts(fmt, image.size[0], image.size[1], frames)


@contextlib.contextmanager
def legacy() -> Iterator[None]:
    current = media_checks.probe_image
    media_checks.probe_image = legacy_probe  # type: ignore[assignment]
    try:
        yield
    finally:
        media_checks.probe_image = current


# ---------------------------------------------------------------- part 1


def latencies(
    small: Callable[[], object], samples: int, load: Callable[[], object] | None, gap: float
) -> list[float]:
    """``samples`` timings of ``small`` at random moments while ``load`` loops in a worker thread.

    Random gaps (up to ``gap`` s) spread the samples over the load's cycle, so a wait
    that happens only in part of it is seen in proportion.
    """
    stop = threading.Event()
    loads = [0]

    def worker() -> None:
        while not stop.is_set():
            load()  # type: ignore[misc]
            loads[0] += 1

    thread = threading.Thread(target=worker, daemon=True) if load else None
    if thread:
        thread.start()
        time.sleep(0.05)
    result, chooser = [], random.Random(0)
    try:
        for _ in range(samples):
            start = time.perf_counter()
            small()
            result.append(time.perf_counter() - start)
            time.sleep(chooser.uniform(0, gap))
    finally:
        stop.set()
        if thread:
            thread.join()
    return result


def stall(quick: bool) -> float:
    frames = 100_000 if quick else 400_000
    big = request(tiny_frame_gif(frames), "image/gif")
    small = request(encode(noise(64, 48), "PNG"), "image/png")
    stills = RuleMatcher(load_policy(None), None)
    animated = RuleMatcher(parse_policy("limits: {allow_animated: true}\n", fmt="yaml"), None)
    unbounded = RuleMatcher(
        parse_policy("limits: {allow_animated: true, max_image_frames: 1000000}\n", fmt="yaml"),
        None,
    )
    assert not validate_body(big, stills).accepted and not validate_body(big, animated).accepted
    assert validate_body(big, unbounded).accepted and validate_body(small, stills).accepted
    print(
        f"big body: {len(big) / 1e6:.1f} MB, a {frames}-frame 8x8 GIF; small body: "
        f"{len(small)} bytes, a 64x48 PNG; GIL switch interval "
        f"{sys.getswitchinterval() * 1e3:.0f} ms"
    )
    samples = 40 if quick else 120
    run = lambda: validate_body(small, stills)  # noqa: E731
    rows, medians = [], {}
    cases: list[tuple[str, Callable[[], object] | None, bool]] = [
        ("alone", None, False),
        ("big GIF, stills (refused at frame 2)", lambda: validate_body(big, stills), False),
        ("big GIF, animated (refused at 1001)", lambda: validate_body(big, animated), False),
        ("big GIF, max_image_frames 10^6 (all)", lambda: validate_body(big, unbounded), False),
        ("big GIF, previous probe (lock)", lambda: validate_body(big, unbounded), True),
    ]
    for label, load, old in cases:
        with legacy() if old else contextlib.nullcontext():
            times = latencies(run, samples // 4 if old else samples, load, 0.4 if old else 0.01)
        medians[label] = statistics.median(times)
        ratio = medians[label] / medians["alone"]
        mean, worst = statistics.fmean(times) * 1e3, max(times) * 1e3
        rows.append((label, len(times), medians[label] * 1e3, mean, worst, ratio))
    print(
        table(("small request while ...", "n", "p50 ms", "mean ms", "max ms", "p50 / alone"), rows)
    )
    return medians["big GIF, stills (refused at frame 2)"] / medians["alone"]


# ---------------------------------------------------------------- part 2


def costs(quick: bool) -> None:
    side = 1024 if quick else 2048
    photo = noise(side, side)
    images = [
        ("JPEG baseline", "jpeg", encode(photo, "JPEG", quality=90), 1),
        ("JPEG progressive", "jpeg", encode(photo, "JPEG", quality=90, progressive=True), 1),
        ("JPEG restarts", "jpeg", encode(photo, "JPEG", quality=90, restart_marker_rows=1), 1),
        ("PNG RGB", "png", encode(photo, "PNG", compress_level=1), 1),
        ("WebP", "webp", encode(photo, "WEBP", quality=80), 1),
        ("GIF 60 frames 256px", "gif", many_frame_gif(60, 256), 60),
    ]
    reps = 3 if quick else 7
    rows = []
    for label, fmt, data, frames in images:
        header = best(lambda d=data, f=fmt: open_image(d, f).size, reps * 3)
        walk = best(lambda d=data, f=fmt: check_structure(d, f, frame_limit=1000), reps)
        verify = best(lambda d=data, f=fmt, n=frames: verify_image_data(d, f, n), reps)
        decode = best(lambda d=data: decode_image(d), reps)
        width, height = Image.open(io.BytesIO(data)).size
        megabytes, megapixels = len(data) / 1e6, width * height * frames / 1e6
        default = header + walk
        rows.append(
            (label, megabytes, megapixels, default * 1e3, walk * 1e3 / megabytes,
             verify * 1e3, verify * 1e3 / megapixels, verify / default, decode * 1e3)
        )  # fmt: skip
    headers = (
        "image", "MB", "MP", "default ms", "walk ms/MB", "verify ms", "verify ms/MP",
        "verify / default", "encoder decode ms",
    )  # fmt: skip
    print("default = Pillow header read + structural walk; verify = verify_image_data;")
    print("encoder decode = decode_image (first frame to RGB), what an accepted image costs later")
    print(table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args()
    print(f"== {NAME}")
    print(machine_line())
    ratio = stall(args.quick)
    print()
    costs(args.quick)
    print(result_line(NAME, ratio, f"<={TARGET}", ratio <= TARGET))


if __name__ == "__main__":
    main()
