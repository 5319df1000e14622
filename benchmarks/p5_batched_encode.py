"""P5: micro-batched encoding at concurrency 16 vs one image per forward pass.

The same local Kimi adapter on the same tiny real Kimi-K2.5 checkpoint (built
here from a config, as in the tests), two batch settings: ``max_items=16``
(requests arriving together share a forward pass) and ``max_items=1`` (one by
one). 16 concurrent requests, one distinct image each, the embedding cache
off so every image reaches the model. Ratio = batched throughput / one-by-one
throughput, interleaved rounds. Target >= 1.5 on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import interleaved, machine_line, print_rounds, result_line
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kimi_tiny import save_full_checkpoint
from modalgate.encoder_adapter import BatchSettings
from modalgate.encoder_adapter.kimi.adapter import KimiEncoderAdapter

NAME = "p5_batched_encode"
TARGET = 1.5
CONCURRENCY = 16


def images(count: int, side: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        pixels = rng.integers(0, 256, (side + i % 3, side, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def save_realistic_tower(directory: Path) -> None:
    """Kimi-K2.5's vision tower at its real size (transformers' config defaults), random weights."""
    import torch
    from transformers import Kimi_K25ImageProcessor, Kimi_K25VisionConfig, Kimi_K25VisionModel

    torch.manual_seed(0)
    Kimi_K25VisionModel(Kimi_K25VisionConfig()).save_pretrained(directory)
    Kimi_K25ImageProcessor().save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--side", type=int, default=112, help="image side in pixels")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument(
        "--realistic",
        action="store_true",
        help="a Kimi-K2.5-size vision tower (27 layers, hidden 1152; random weights) for GPUs",
    )
    args = parser.parse_args()
    rounds, reps = (3, 1) if args.quick else (9, 3)

    print(f"== {NAME}")
    print(machine_line())
    with tempfile.TemporaryDirectory() as directory:
        if args.realistic:
            save_realistic_tower(Path(directory))
        else:
            save_full_checkpoint(Path(directory))
        batch = images(CONCURRENCY, args.side)
        loop = asyncio.new_event_loop()
        adapters = {
            max_items: KimiEncoderAdapter(
                directory,
                batch=BatchSettings(max_items=max_items, max_wait_ms=2.0),
                cache_bytes=0,
                device=args.device,
            )
            for max_items in (CONCURRENCY, 1)
        }

        def burst(adapter: KimiEncoderAdapter) -> None:
            async def all_at_once() -> None:
                results = await asyncio.gather(*(adapter.encode([image]) for image in batch))
                assert all(r[0].error is None for r in results)

            loop.run_until_complete(all_at_once())

        for adapter in adapters.values():  # warm-up: first forward, allocator, decode pool
            burst(adapter)
        tower = "Kimi-K2.5-size tower" if args.realistic else "tiny Kimi-K2.5 tower"
        print(
            f"{tower} on {args.device}; {CONCURRENCY} concurrent "
            f"requests of one {args.side}x{args.side} PNG each; cache off"
        )
        print(f"{rounds} rounds x {reps} bursts, interleaved; per round the median of each")
        start = time.perf_counter()
        result = interleaved(
            lambda: burst(adapters[1]),
            lambda: burst(adapters[CONCURRENCY]),
            rounds=rounds,
            reps=reps,
            ratio=lambda one_by_one, batched: one_by_one / batched,
        )
        print_rounds(result, "one-by-one", "batched", time.perf_counter() - start)
        batched = adapters[CONCURRENCY].batcher
        print(
            f"batched adapter: {batched.items} images in {batched.batches} forward passes "
            f"({batched.items / max(1, batched.batches):.1f} per pass)"
        )
        for adapter in adapters.values():
            loop.run_until_complete(adapter.close())
        loop.close()
    print(result_line(NAME, result.ratio, f">={TARGET}", result.ratio >= TARGET))


if __name__ == "__main__":
    main()
