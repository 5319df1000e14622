"""P12: what checking a PNG's pixel data to its end costs, beside what the server pays to decode it.

The gate inflates every accepted PNG's zlib streams (``media.png_pixels``): a stream
that is damaged, stops early or holds a row too few kills ``transformers serve``
(tests/realserver). This prints, per image: the structural walk alone, the walk plus
the pixel check (``check_structure``, the gate's default), the pixel check's share in
ms per MB of PNG and per MB of inflated rows, and, side by side in the same run, the
server's own decode of the same bytes: Pillow's full decode (``Image.load``) and
torchvision's ``decode_image`` where torchvision is installed (what transformers
loads images with). A last table inflates the same streams with the standard
library's zlib and with zlib-ng (the gate's), which is why the check is cheap.

Ratio = median over the images of (pixel check ms / server decode ms), the server
decode being torchvision's where present, else Pillow's. Target: <= 0.25 (the check
costs at most a quarter of the decode every accepted image gets anyway). Met by
compressible images (screenshots, flat: ~0.03-0.04), missed by incompressible ones
(noise, photos saved as PNG: ~0.41-0.61): there 96% of the check is zlib-ng's inflate
of Huffman-coded blocks (~470 MB/s, cProfile), the same inflate that is about half of
the decoder's own work, so no check that inflates to the end can cost much less.

Usage: .venv/bin/python benchmarks/png_pixel_check.py [--quick]
"""

from __future__ import annotations

import io
import statistics
import zlib
from collections.abc import Callable

import numpy as np
from _common import begin, best, result_line, table
from PIL import Image
from zlib_ng import zlib_ng

from modalgate.media.image_integrity import _png_walk, check_structure
from modalgate.media.png_pixels import raw_size

NAME = "png_pixel_check"
TARGET = 0.25


def encode(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **options)
    return buffer.getvalue()


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), np.uint8)
    return Image.fromarray(pixels.squeeze() if channels == 1 else pixels, mode)


def screenshot(width: int, height: int) -> Image.Image:
    """Flat panels, text-like stripes and a gradient: what a UI capture compresses like."""
    pixels = np.full((height, width, 3), 245, np.uint8)
    pixels[: height // 12] = (40, 44, 52)
    pixels[:, : width // 6] = (230, 232, 236)
    rows = np.arange(height)[:, None]
    stripes = ((rows // 3) % 7 == 0) & (np.arange(width)[None, :] % 11 < 8)
    pixels[stripes] = (30, 30, 30)
    pixels[height // 2 :, width // 2 :, 0] = np.linspace(0, 255, width - width // 2, dtype=np.uint8)
    return Image.fromarray(pixels)


def images(quick: bool) -> list[tuple[str, bytes]]:
    side = 1024 if quick else 2048
    return [
        ("noise RGB 512^2", encode(noise(512, 512))),
        (f"noise RGB {side}^2", encode(noise(side, side))),
        (f"noise RGBA {side}^2", encode(noise(side, side, "RGBA"))),
        ("noise L 1024^2 interlaced", encode(noise(1024, 1024, "L"), optimize=False, interlace=1)),
        ("screenshot 1920x1080", encode(screenshot(1920, 1080))),
        ("screenshot 3840x2160", encode(screenshot(3840, 2160))),
        ("palette 1024^2", encode(noise(1024, 1024).quantize(64))),
        ("flat 4000x3000", encode(Image.new("RGB", (4000, 3000), (200, 120, 40)))),
    ]


def server_decoders() -> dict[str, Callable[[bytes], object]]:
    decoders: dict[str, Callable[[bytes], object]] = {
        "Pillow": lambda data: Image.open(io.BytesIO(data)).load()
    }
    try:
        import torch
        from torchvision.io import decode_image
    except ImportError:
        return decoders

    def torchvision_decode(data: bytes) -> object:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    decoders["torchvision"] = torchvision_decode
    return decoders


def inflated_size(data: bytes) -> int:
    layout, _ = _png_walk(data, 1, None)
    width, height, _spans = layout.streams[0]
    return raw_size(width, height, layout.bits_per_pixel, layout.interlaced)


def idat_stream(data: bytes) -> bytes:
    layout, _ = _png_walk(data, 1, None)
    return b"".join(data[start : start + length] for start, length in layout.streams[0][2])


def main() -> None:
    args = begin(NAME, __doc__)
    reps = 3 if args.quick else 7
    decoders = server_decoders()
    server = "torchvision" if "torchvision" in decoders else "Pillow"
    rows, inflate_rows, ratios = [], [], []
    for label, data in images(args.quick):
        assert check_structure(data, "png") is not None  # every image here passes the gate
        walk = best(lambda d=data: _png_walk(d, 1, None), reps)
        full = best(lambda d=data: check_structure(d, "png"), reps)
        decode = {name: best(lambda d=data, f=f: f(d), reps) for name, f in decoders.items()}
        pixels = max(full - walk, 0.0)
        megabytes, inflated = len(data) / 1e6, inflated_size(data) / 1e6
        ratios.append(pixels / decode[server])
        rows.append(
            (label, megabytes, inflated, walk * 1e3, full * 1e3, pixels * 1e3 / megabytes,
             pixels * 1e3 / inflated, *(decode[n] * 1e3 for n in decoders), ratios[-1])
        )  # fmt: skip
        stream = idat_stream(data)
        plain = best(lambda s=stream: zlib.decompress(s), reps)
        fast = best(lambda s=stream: zlib_ng.decompress(s), reps)
        inflate_rows.append((label, inflated, plain * 1e3, fast * 1e3, plain / fast))
    headers = (
        "PNG", "MB", "rows MB", "walk ms", "walk+pixels ms", "pixels ms/MB", "pixels ms/rows MB",
        *(f"{n} decode ms" for n in decoders), f"pixels / {server}",
    )  # fmt: skip
    print("walk = chunk structure only; walk+pixels = check_structure, the gate's default")
    print(table(headers, rows))
    print()
    print("the same IDAT streams inflated whole (one call, output kept):")
    print(table(("PNG", "rows MB", "zlib ms", "zlib-ng ms", "zlib / zlib-ng"), inflate_rows))
    ratio = statistics.median(ratios)
    print(f"median pixel check / {server} decode: {ratio:.3f} (max {max(ratios):.3f})")
    print(result_line(NAME, ratio, f"<={TARGET}", ratio <= TARGET))


if __name__ == "__main__":
    main()
