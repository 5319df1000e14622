"""Shared parts of the benchmark scripts: test media, request bodies, interleaved timing, reports.

The machine these run on is small and shared, so absolute times drift from run to
run. Every benchmark therefore measures its two contenders side by side in the
same run, in interleaved rounds, and reports the median of the per-round ratios
together with their spread (min..max over rounds).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pybase64
from PIL import Image

# Random noise barely compresses, so a JPEG of it at quality 92 is ~0.97 bytes per
# pixel: 1440x1440 gives ~2.0 MB per image, four of them a ~10.7 MB request body.
DEFAULT_SIDE = 1440
DEFAULT_QUALITY = 92


def noise_jpeg(side: int = DEFAULT_SIDE, quality: int = DEFAULT_QUALITY, seed: int = 0) -> bytes:
    """A real baseline JPEG of random RGB noise (deterministic for a given seed)."""
    noise = random.Random(seed).randbytes(side * side * 3)
    image = Image.frombytes("RGB", (side, side), noise)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64,{pybase64.b64encode(data).decode('ascii')}"


def four_image_request(images: Sequence[bytes], model: str = "kimi-k3") -> dict[str, object]:
    """An OpenAI-style chat request: a system message, then text plus one image_url per image."""
    parts: list[dict[str, object]] = [
        {
            "type": "text",
            "text": "Here are four photos from the site survey. Describe each one, "
            "then list any differences you notice between them.",
        }
    ]
    for i, image in enumerate(images):
        parts.append({"type": "text", "text": f"Photo {i + 1}:"})
        parts.append({"type": "image_url", "image_url": {"url": data_url(image), "detail": "high"}})
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a careful visual inspector. Answer briefly."},
            {"role": "user", "content": parts},
        ],
        "max_tokens": 512,
        "temperature": 0.2,
    }


def build_big_body(
    side: int = DEFAULT_SIDE, quality: int = DEFAULT_QUALITY
) -> tuple[bytes, list[bytes]]:
    """The ~10 MB body shared by P2 and P3 (compact JSON, as SDKs send it) and its JPEGs."""
    import json

    images = [noise_jpeg(side, quality, seed=i) for i in range(4)]
    body = json.dumps(four_image_request(images), separators=(",", ":")).encode()
    return body, images


def describe_body(body: bytes, images: Sequence[bytes], side: int, quality: int) -> str:
    sizes = ", ".join(f"{len(i) / 1e6:.2f}" for i in images)
    return (
        f"body: {len(body) / 1e6:.2f} MB ({len(body)} bytes), 4 JPEGs {side}x{side} q{quality} "
        f"of noise: [{sizes}] MB (decoded), each ~{len(images[0]) * 4 / 3 / 1e6:.2f} MB as base64"
    )


# ---------------------------------------------------------------- timing


def time_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Rounds:
    """Per-round measurements of two contenders, A and B, and the per-round ratio."""

    a: list[float]
    b: list[float]
    ratios: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def interleaved(
    fn_a: Callable[[], object],
    fn_b: Callable[[], object],
    rounds: int,
    reps: int,
    ratio: Callable[[float, float], float],
    pick: Callable[[list[float]], float] = statistics.median,
) -> Rounds:
    """Per round: ``reps`` calls of A and B alternated (order flipped every round).

    Each round contributes ``pick`` of its A times and of its B times, and one ratio.
    """
    result = Rounds([], [], [])
    for r in range(rounds):
        times_a: list[float] = []
        times_b: list[float] = []
        for k in range(reps):
            if (r + k) % 2 == 0:
                times_a.append(time_call(fn_a))
                times_b.append(time_call(fn_b))
            else:
                times_b.append(time_call(fn_b))
                times_a.append(time_call(fn_a))
        a, b = pick(times_a), pick(times_b)
        result.a.append(a)
        result.b.append(b)
        result.ratios.append(ratio(a, b))
    return result


# ---------------------------------------------------------------- reporting


def print_rounds(result: Rounds, label_a: str, label_b: str, elapsed: float) -> None:
    """The per-round table and the median line every side-by-side benchmark prints."""
    rows = [
        (i + 1, a * 1e3, b * 1e3, r)
        for i, (a, b, r) in enumerate(zip(result.a, result.b, result.ratios, strict=True))
    ]
    print(table(("round", f"{label_a} ms", f"{label_b} ms", "ratio"), rows))
    print(
        f"median: {label_a} {statistics.median(result.a) * 1e3:.1f} ms, "
        f"{label_b} {statistics.median(result.b) * 1e3:.1f} ms; "
        f"ratio {result.ratio:.2f} (spread {spread(result.ratios)}), {elapsed:.1f} s"
    )


def best(function: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` calls, in seconds: the one least disturbed by the machine."""
    return min(time_call(function) for _ in range(reps))


def begin(name: str, doc: str, **more: str) -> argparse.Namespace:
    """The opening every benchmark prints: ``--quick`` (and the flags in ``more``, each
    ``--flag``: help) parsed, its name and the machine line."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    for flag, help_text in more.items():
        parser.add_argument(f"--{flag}", action="store_true", help=help_text)
    args = parser.parse_args()
    print(f"== {name}")
    print(machine_line())
    return args


def machine_line() -> str:
    """Interpreter, cores, and the load average: other work on the machine skews every number."""
    cores = os.cpu_count()
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    return (
        f"machine: {platform.python_implementation()} {platform.python_version()}, "
        f"{cores} cores, load average {load}"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    left = [isinstance(c, str) for c in rows[0]] if rows else [False] * len(headers)
    lines = [
        "  ".join(
            c.ljust(w) if is_left else c.rjust(w)
            for c, w, is_left in zip(row, widths, left, strict=True)
        ).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def spread(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f}..{max(ratios):.2f}"


def result_line(name: str, ratio: float, target: str, passed: bool) -> str:
    """The one line ``run_all.py`` collects: ``RESULT <name> ratio=<x.xx> target=<t> PASS|FAIL``."""
    return f"RESULT {name} ratio={ratio:.2f} target={target} {'PASS' if passed else 'FAIL'}"
