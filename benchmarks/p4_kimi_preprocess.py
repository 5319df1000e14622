"""P4: KimiPreprocessor vs transformers' Kimi_K25ImageProcessor on the CPU.

Both turn the same RGB PIL images into MoonViT input (``pixel_values [N, 3, 14,
14]`` float32 and the grid); the outputs are asserted equal (max abs difference
<= 1e-6, grids identical) before anything is timed. The reference is built the
way users build it and called as users call it (``return_tensors="pt"``).

Settings: Kimi-K3 (patch 14, merge 2, max_patches 65536, max_side 512 patches),
plus one Kimi-K2.5 row (max_patches 16384, the processor's defaults), where a
4000x3000 photo must be downscaled, so the resize path is timed too. Images are
synthetic but photo-like (smooth gradients, shapes, mild sensor noise);
preprocessing time does not depend on content.

Both run under the same ``torch.set_num_threads`` (default 1: on a small shared
machine, multi-threaded timings mostly measure the other tenants; ``--threads``
to change it).

Ratio = reference time / KimiPreprocessor time on 1920x1080 with the K3 settings
(per round: median of the reps). Target: >= 3. Rows for 640x480 and 4000x3000
are printed as context.

The plane reader's worth is measured too (context, no target): with it
(``modalgate.media.pillow_planes`` reading Pillow's memory in place) and without it
(its copy fallback: ``tobytes`` per plane, ``np.asarray`` for a resize's input,
what runs where Pillow has no Arrow export), alternated, on the read alone and on
the whole call: 1920x1080 K3 (planes, no resize) and 2560x1440 K2.5 (a resize of
pixels in one Pillow block; 4000x3000 RGB is in several, so always copied).

Usage: .venv/bin/python benchmarks/p4_kimi_preprocess.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from _common import (
    interleaved,
    machine_line,
    print_rounds,
    result_line,
    spread,
    table,
    time_call,
)
from PIL import Image
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

from modalgate.encoder_adapter.kimi import preprocess
from modalgate.encoder_adapter.kimi.preprocess import KimiPreprocessor
from modalgate.media import pillow_planes

NAME = "p4_kimi_preprocess"
TARGET = 3.0
HEADLINE = (1920, 1080)


@dataclass(frozen=True)
class Settings:
    label: str
    max_patches: int
    max_side: int = 512  # patches per side

    def reference(self) -> Kimi_K25ImageProcessor:
        return Kimi_K25ImageProcessor(
            patch_size=14,
            merge_size=2,
            max_patches=self.max_patches,
            size={"max_height": self.max_side, "max_width": self.max_side},
        )

    def ours(self) -> KimiPreprocessor:
        return KimiPreprocessor(
            patch_size=14, merge_size=2, max_patches=self.max_patches, max_side=self.max_side
        )


K3 = Settings("K3", 65536)
K25 = Settings("K2.5", 16384)
# (width, height, settings); the headline first.
ROWS = ((*HEADLINE, K3), (640, 480, K3), (4000, 3000, K3), (4000, 3000, K25))
# The plane reader with and without: (width, height, settings, the reader's function).
READER_ROWS = ((*HEADLINE, K3, "planes"), (2560, 1440, K25, "pixels"))


def photo_like(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB image with photo-like structure: gradients, soft shapes, noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y /= max(height - 1, 1)
    x /= max(width - 1, 1)
    sky = np.stack([90 + 80 * y, 140 + 60 * y, 220 - 90 * y], axis=-1)
    ground = np.stack([70 + 60 * x, 110 + 40 * np.sin(9 * x), 50 + 30 * y], axis=-1)
    image = np.where((y > 0.55 + 0.08 * np.sin(5 * x))[..., None], ground, sky)
    for _ in range(6):  # soft discs: "objects"
        cx, cy, r = rng.random(), rng.random(), 0.05 + 0.15 * rng.random()
        disc = np.clip(1.5 - np.hypot((x - cx) * width / height, y - cy) / r, 0, 1)[..., None]
        image = image * (1 - disc) + rng.integers(0, 256, 3).astype(np.float32) * disc
    image += rng.normal(0, 4, image.shape).astype(np.float32)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def check_same(
    reference: Kimi_K25ImageProcessor, ours: KimiPreprocessor, image: Image.Image
) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """Max abs difference of pixel_values (<= 1e-6), shape, grid row; grids must be equal."""
    expected = reference([image], return_tensors="pt")
    pixels, grid = ours([image])
    assert torch.equal(grid, expected["image_grid_thw"]), (grid, expected["image_grid_thw"])
    assert pixels.shape == expected["pixel_values"].shape
    diff = (pixels - expected["pixel_values"]).abs().max().item()
    assert diff <= 1e-6, diff
    return diff, tuple(pixels.shape), tuple(grid[0].tolist())


def cpu_time_ratio(
    reference: Kimi_K25ImageProcessor, ours: KimiPreprocessor, image: Image.Image, rounds: int
) -> tuple[float, float]:
    """Median thread CPU time of each, alternating: what other tenants' load skews least."""
    times: tuple[list[float], list[float]] = ([], [])
    calls = (lambda: reference([image], return_tensors="pt"), lambda: ours([image]))
    for round_ in range(rounds):
        for index in (0, 1) if round_ % 2 == 0 else (1, 0):
            start = time.thread_time()
            calls[index]()
            times[index].append(time.thread_time() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def ours_by_stage(
    ours: KimiPreprocessor, image: Image.Image, reps: int = 7
) -> list[tuple[str, float]]:
    """Where KimiPreprocessor's time goes on one image (median seconds per stage, warm)."""
    (_, padded) = ours.sizes_for(*image.size)
    planes = pillow_planes.planes(image)

    def patchify_all() -> None:  # the uint8 part of _fill_cpu's band loop
        for _ in preprocess._bands(planes, padded, ours.patch_size):
            pass

    def median(fn: Callable[[], object]) -> float:
        return statistics.median(time_call(fn) for _ in range(reps))

    read = median(lambda: pillow_planes.planes(image))
    patchify = median(patchify_all)
    total = median(lambda: ours([image]))
    return [
        ("read R, G, B planes (Pillow split, zero-copy)", read),
        ("patchify + pad, uint8 (numpy, per band)", patchify),
        ("allocate, cast, subtract, divide (numpy, per band)", total - read - patchify),
        ("total", total),
    ]


@contextlib.contextmanager
def without_reader() -> Iterator[None]:
    """The plane reader switched off: ``pillow_planes`` takes its copy fallback."""
    saved = pillow_planes._capsule_pointer
    pillow_planes._capsule_pointer = None
    try:
        yield
    finally:
        pillow_planes._capsule_pointer = saved


def reader_rows(rounds: int, reps: int) -> list[tuple[object, ...]]:
    """The plane reader's worth: without ÷ with, alternated, on the read alone and on
    ``KimiPreprocessor``'s whole call; outputs asserted equal first."""
    rows: list[tuple[object, ...]] = []
    for index, (width, height, settings, name) in enumerate(READER_ROWS):
        ours = settings.ours()
        image = photo_like(width, height, seed=10 + index)
        read = getattr(pillow_planes, name)
        resized = ours.sizes_for(width, height)[0] != (height, width)
        assert resized == (name == "pixels"), (width, height, settings.label, name)

        def read_without(read: Callable[..., object] = read, image: Image.Image = image) -> object:
            with without_reader():
                return read(image)

        def ours_without(ours: KimiPreprocessor = ours, image: Image.Image = image) -> object:
            with without_reader():
                return ours([image])

        def arrays(result: object) -> list[np.ndarray]:
            return result if isinstance(result, list) else [result]

        fast, slow = arrays(read(image)), arrays(read_without())
        assert all(isinstance(a.base, pillow_planes.PillowMemory) for a in fast), "not in place"
        assert not any(isinstance(a.base, pillow_planes.PillowMemory) for a in slow)
        expected = np.asarray(image)
        for result in (fast, slow):
            got = result[0][..., :3] if len(result) == 1 else np.stack(result, axis=-1)
            assert np.array_equal(got, expected)
        with without_reader():
            copied = ours([image])[0]
        assert torch.equal(ours([image])[0], copied)
        for label, with_, without in (
            (f"pillow_planes.{name}()", lambda r=read, i=image: r(i), read_without),
            ("KimiPreprocessor", lambda o=ours, i=image: o([i]), ours_without),
        ):
            for _ in range(2):  # warm-up
                with_()
                without()
            result = interleaved(without, with_, rounds=rounds, reps=reps, ratio=lambda a, b: a / b)
            rows.append(
                (
                    f"{width}x{height} {settings.label}",
                    label,
                    statistics.median(result.b) * 1e3,
                    statistics.median(result.a) * 1e3,
                    f"{result.ratio:.2f}",
                    spread(result.ratios),
                    f"{rounds}x{reps}",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds for the headline row")
    parser.add_argument("--reps", type=int, default=None, help="calls of each per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, both")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 21)
    reps = args.reps or (2 if args.quick else 5)
    torch.set_num_threads(args.threads)

    print(f"== {NAME}")
    print(machine_line())
    print(
        f"torch {torch.__version__} (torch.set_num_threads({torch.get_num_threads()}) for both), "
        f"numpy {np.__version__}, Pillow {Image.__version__}"
    )
    print("reference: Kimi_K25ImageProcessor(...)([image], return_tensors='pt')")
    print("ours: KimiPreprocessor(...)([image])  (CPU)")
    print(
        f"headline {HEADLINE[0]}x{HEADLINE[1]} {K3.label}: {rounds} rounds x {reps} reps, "
        "interleaved; per round the median of each"
    )

    rows = []
    headline = None
    context: list[str] = []
    for index, (width, height, settings) in enumerate(ROWS):
        reference, ours = settings.reference(), settings.ours()
        image = photo_like(width, height, seed=index)
        diff, shape, grid = check_same(reference, ours, image)
        for _ in range(2):  # warm-up
            reference([image], return_tensors="pt")
            ours([image])
        is_headline = index == 0
        row_rounds = rounds if is_headline else max(3, rounds // 3)
        row_reps = reps if is_headline else max(1, reps // 2)
        start = time.perf_counter()
        result = interleaved(
            lambda r=reference, i=image: r([i], return_tensors="pt"),
            lambda o=ours, i=image: o([i]),
            rounds=row_rounds,
            reps=row_reps,
            ratio=lambda ref, mine: ref / mine,
        )
        elapsed = time.perf_counter() - start
        if is_headline:
            headline = result
            print(
                f"\n{width}x{height} {settings.label}: pixel_values {shape}, grid {grid}, "
                f"max abs diff {diff:g}"
            )
            print_rounds(result, "reference", "ours", elapsed)
            calls = max(3, rounds)
            ref_cpu, ours_cpu = cpu_time_ratio(reference, ours, image, calls)
            context.append(
                f"thread CPU time, same image, {calls} alternating calls each: reference "
                f"{ref_cpu * 1e3:.1f} ms, ours {ours_cpu * 1e3:.1f} ms, "
                f"ratio {ref_cpu / ours_cpu:.2f}"
            )
            stages = [(label, t * 1e3) for label, t in ours_by_stage(ours, image)]
        rows.append(
            (
                f"{width}x{height}",
                settings.label,
                f"{shape[0]}",
                statistics.median(result.a) * 1e3,
                statistics.median(result.b) * 1e3,
                f"{result.ratio:.2f}",
                spread(result.ratios),
                f"{row_rounds}x{row_reps}",
                f"{diff:g}",
            )
        )

    print()
    print(
        table(
            (
                "image",
                "settings",
                "patches",
                "reference ms",
                "ours ms",
                "ratio",
                "spread",
                "rounds",
                "max diff",
            ),
            rows,
        )
    )
    print()
    for line in context:
        print(line)
    print(f"ours on {HEADLINE[0]}x{HEADLINE[1]}, by stage (median of 7, warm):")
    print(table(("stage", "ms"), stages))
    print()
    reader_rounds, reader_reps = max(3, rounds // 3), reps
    print(
        "plane reader, with (Pillow's memory in place) and without (its copy fallback), "
        "alternated; ratio = without / with:"
    )
    print(
        table(
            ("image", "call", "with ms", "without ms", "ratio", "spread", "rounds"),
            reader_rows(reader_rounds, reader_reps),
        )
    )
    assert headline is not None
    print(result_line(NAME, headline.ratio, f">={TARGET:g}", headline.ratio >= TARGET))


if __name__ == "__main__":
    main()
