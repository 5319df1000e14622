"""The differential corpus: request bodies generated (not listed) to probe a real VLM server.

Every image is made here by Pillow or byte by byte, then cut, corrupted or dressed
as something else; every other modality and part shape the OpenAI chat and
Responses APIs define (and the engines' extensions) has its part; URLs of every
scheme. Each case is (name, body); the model name is filled in by the caller.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image, features

from conftest import b64
from media_stubs import MP4_BYTES, PDF_BYTES, WAV_BYTES, png_chunk, png_of, png_rows

Case = tuple[str, dict[str, Any]]
MIMES = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
}


def chat(model: str, *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "Describe the picture."}, *parts]
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def image_url(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(data)}"}}


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def writable_formats() -> list[str]:
    """Every format this Pillow writes from an RGB image (AVIF, JPEG 2000... where built)."""
    found = []
    for fmt in sorted(Image.SAVE):
        if fmt in ("PDF", "EPS", "PALM", "XBM", "MPO", "SPIDER", "IM", "H5", "HDF5", "BUFR"):
            continue  # not images a client would send, or need a tool this machine lacks
        try:
            if encode(noise(8, 8), fmt):
                found.append(fmt)
        except Exception:
            continue
    return found


def _pillow_formats(model: str) -> Iterator[Case]:
    for fmt in writable_formats():
        mime = MIMES.get(fmt, f"image/{fmt.lower()}")
        for width, height in ((64, 48), (300, 200)):
            yield (
                f"format-{fmt}-{width}x{height}",
                chat(model, image_url(encode(noise(width, height), fmt), mime)),
            )


def _sizes(model: str) -> Iterator[Case]:
    sides = [(1, 1), (2, 2), (8, 8), (27, 27), (28, 28), (29, 40), (56, 56), (1, 300)]
    sides += [(300, 1), (10, 500), (500, 10), (1000, 1000), (2000, 1500), (4000, 3000)]
    sides += [(7168, 7168), (7169, 7168), (12000, 12000)]
    for width, height in sides:
        for fmt in ("PNG", "JPEG"):
            if width * height > 60_000_000 and fmt == "JPEG":
                continue  # libjpeg: one such image is enough, as a PNG
            image = Image.new("RGB", (width, height), (40, 120, 200))
            yield (
                f"size-{fmt}-{width}x{height}",
                chat(model, image_url(encode(image, fmt), MIMES[fmt])),
            )


def _modes(model: str) -> Iterator[Case]:
    base = noise(48, 40)
    for mode in ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "I;16", "I", "F", "CMYK", "YCbCr"):
        for fmt in ("PNG", "JPEG", "TIFF", "WEBP", "GIF", "BMP"):
            try:
                data = encode(base.convert(mode), fmt)
            except (OSError, ValueError, KeyError):
                continue
            yield f"mode-{fmt}-{mode}", chat(model, image_url(data, MIMES[fmt]))


def _exif_and_animation(model: str) -> Iterator[Case]:
    image = noise(60, 40)
    for orientation in (1, 3, 6, 8):
        exif = Image.Exif()
        exif[0x0112] = orientation
        data = encode(image, "JPEG", exif=exif.tobytes())
        yield f"exif-orientation-{orientation}", chat(model, image_url(data, "image/jpeg"))
    frames = [noise(32, 32, seed) for seed in range(3)]
    for fmt in ("GIF", "PNG", "WEBP"):
        data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50)
        yield f"animated-{fmt}", chat(model, image_url(data, MIMES[fmt]))
    rows = zlib.compress(png_rows(40, 40))
    fctl = struct.pack(">IIIIIHHBB", 0, 40, 40, 0, 0, 1, 10, 0, 0)
    hidden = (
        png_of(40, 40, rows, tail=b"")[: -len(png_chunk(b"IDAT", rows))]
        + png_chunk(b"acTL", struct.pack(">II", 1, 0))
        + png_chunk(b"IDAT", rows)
        + png_chunk(b"fcTL", fctl)
        + png_chunk(b"fdAT", struct.pack(">I", 1) + rows)
        + png_chunk(b"IEND", b"")
    )
    yield "animated-apng-default-not-a-frame", chat(model, image_url(hidden))


def _boundaries(data: bytes, fmt: str) -> list[int]:
    """Chunk, marker or block boundaries of ``data``, and a point inside each span."""
    cuts: list[int] = []
    if fmt == "PNG":
        pos = 8
        while pos + 8 <= len(data):
            cuts.append(pos)
            pos += 12 + struct.unpack_from(">I", data, pos)[0]
    elif fmt == "JPEG":
        cuts = [
            i for i in range(2, len(data) - 1) if data[i] == 0xFF and data[i + 1] not in (0, 0xFF)
        ]
        cuts = [i for i in cuts if not 0xD0 <= data[i + 1] <= 0xD7]  # restart markers: in scans
    elif fmt == "GIF":
        cuts = [6, 13, 13 + 768, len(data) // 2, len(data) - 1]
    else:  # RIFF
        pos = 12
        while pos + 8 <= len(data):
            cuts.append(pos)
            pos += 8 + int.from_bytes(data[pos + 4 : pos + 8], "little") + 1 & ~1
    inside = [(a + b) // 2 for a, b in zip(cuts, [*cuts[1:], len(data)], strict=False) if b - a > 2]
    return sorted(set(cuts + inside) - {0, len(data)})


_ENDS = {"PNG": png_chunk(b"IEND", b""), "JPEG": b"\xff\xd9", "GIF": b";", "WEBP": b""}


def _truncations(model: str) -> Iterator[Case]:
    for fmt in ("PNG", "JPEG", "GIF", "WEBP"):
        source = noise(120, 90).convert("P") if fmt == "GIF" else noise(120, 90)
        whole = encode(source, fmt, **({"progressive": True} if fmt == "JPEG" else {}))
        for cut in _boundaries(whole, fmt):
            yield f"truncated-{fmt}-at-{cut}", chat(model, image_url(whole[:cut], MIMES[fmt]))
            if _ENDS[fmt]:
                glued = whole[:cut] + _ENDS[fmt]
                yield (
                    f"truncated-{fmt}-at-{cut}-end-glued",
                    chat(model, image_url(glued, MIMES[fmt])),
                )


def _corrupt_pixels(model: str) -> Iterator[Case]:
    for side in (2, 32, 64, 200):
        rows = png_rows(side, side)
        packed = bytearray(zlib.compress(rows))
        for i in range(6, min(len(packed) - 4, 30)):
            packed[i] ^= 0x5A
        adler = bytearray(zlib.compress(rows))
        adler[-1] ^= 1
        variants = {
            "zlib-corrupt": bytes(packed),
            "row-short": zlib.compress(rows[: -(3 * side + 1)]),
            "bytes-short": zlib.compress(rows[:-3]),
            "row-extra": zlib.compress(rows + rows[: 3 * side + 1]),
            "filter-invalid": zlib.compress(png_rows(side, side, row_filter=9)),
            "stream-unfinished": zlib.compressobj().compress(rows),
            "stream-no-final-block": _sync_flushed(rows),
            "adler-bad": bytes(adler),
            "row-extra-much": zlib.compress(rows + bytes(70_000)),
        }
        for name, raw in variants.items():
            yield f"png-{name}-{side}", chat(model, image_url(png_of(side, side, raw)))
        yield (
            f"png-no-iend-{side}",
            chat(model, image_url(png_of(side, side, zlib.compress(rows), tail=b""))),
        )
    jpeg = bytearray(encode(noise(64, 64), "JPEG"))
    start = jpeg.rindex(b"\xff\xda") + 20
    for i in range(start, start + 200, 3):
        jpeg[i] ^= 0xA5
    yield "jpeg-scan-corrupt", chat(model, image_url(bytes(jpeg), "image/jpeg"))
    gif = bytearray(encode(noise(64, 64).convert("P"), "GIF"))
    for i in range(len(gif) // 2, len(gif) // 2 + 40):
        gif[i] ^= 0x33
    yield "gif-lzw-corrupt", chat(model, image_url(bytes(gif), "image/gif"))


def _sync_flushed(raw: bytes) -> bytes:
    packer = zlib.compressobj()
    return packer.compress(raw) + packer.flush(zlib.Z_SYNC_FLUSH)


def _polyglots(model: str) -> Iterator[Case]:
    png = encode(noise(40, 40), "PNG")
    yield "polyglot-png-then-mp4", chat(model, image_url(png + MP4_BYTES))
    yield "polyglot-png-then-zip", chat(model, image_url(png + b"PK\x03\x04" + b"\x00" * 40))
    yield (
        "polyglot-jpeg-then-pdf",
        chat(model, image_url(encode(noise(40, 40), "JPEG") + PDF_BYTES, "image/jpeg")),
    )
    others = {
        "mp4": MP4_BYTES,
        "pdf": PDF_BYTES,
        "wav": WAV_BYTES,
        "html": b"<!DOCTYPE html><html><body>hi</body></html>",
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
        "random": np.random.default_rng(1).bytes(500),
        "empty": b"",
        "zeros": b"\x00" * 64,
        "text": b"hello world",
    }
    for name, data in others.items():
        yield f"as-image-{name}", chat(model, image_url(data))
        yield (
            f"as-image-{name}-generic-mime",
            chat(model, image_url(data, "application/octet-stream")),
        )


def _other_parts(model: str) -> Iterator[Case]:
    png_url = f"data:image/png;base64,{b64(encode(noise(40, 40), 'PNG'))}"
    mp4_url = f"data:video/mp4;base64,{b64(MP4_BYTES)}"
    wav = b64(WAV_BYTES)
    parts: dict[str, Any] = {
        "video_url": {"type": "video_url", "video_url": {"url": mp4_url}},
        "input_audio": {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        "audio_url": {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{wav}"}},
        "file": {
            "type": "file",
            "file": {
                "file_data": f"data:application/pdf;base64,{b64(PDF_BYTES)}",
                "filename": "a.pdf",
            },
        },
        "file-id": {"type": "file", "file": {"file_id": "file-abc123"}},
        "image_embeds": {"type": "image_embeds", "image_embeds": "AAAA"},
        "audio_embeds": {"type": "audio_embeds", "audio_embeds": "AAAA"},
        "image_pil": {"type": "image_pil", "image_pil": png_url},
        "refusal": {"type": "refusal", "refusal": "no"},
        "unknown-type": {"type": "hologram", "hologram": {"url": png_url}},
        "no-type": {"image_url": {"url": png_url}},
        "image_url-string": {"type": "image_url", "image_url": png_url},
        "image_url-no-url": {"type": "image_url", "image_url": {}},
        "image_url-null": {"type": "image_url", "image_url": None},
        "text-not-string": {"type": "text", "text": 5},
        "input_image": {"type": "input_image", "image_url": png_url},
        "input_text": {"type": "input_text", "text": "hi"},
        "input_file": {"type": "input_file", "file_data": b64(PDF_BYTES), "filename": "a.pdf"},
    }
    for detail in ("auto", "low", "high", "original", "ultra"):
        parts[f"image_url-detail-{detail}"] = {
            "type": "image_url",
            "image_url": {"url": png_url, "detail": detail},
        }
    for name, part in parts.items():
        yield f"part-{name}", chat(model, part)
    yield (
        "part-image-in-system",
        {
            "model": model,
            "max_tokens": 2,
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "image_url", "image_url": {"url": png_url}}],
                },
                {"role": "user", "content": "hi"},
            ],
        },
    )
    yield (
        "part-image-in-assistant",
        {
            "model": model,
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "image_url", "image_url": {"url": png_url}}],
                },
                {"role": "user", "content": "and?"},
            ],
        },
    )
    for count in (2, 8):
        many = [{"type": "image_url", "image_url": {"url": png_url}}] * count
        yield f"images-{count}", chat(model, *many)
    yield "text-only", chat(model)
    yield (
        "text-string-content",
        {
            "model": model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}],
        },
    )


def _urls(model: str) -> Iterator[Case]:
    urls = {
        "http-loopback": "http://127.0.0.1:1/a.png",
        "https-metadata": "https://169.254.169.254/latest/meta-data/",
        "http-metadata": "http://169.254.169.254/latest/meta-data/",
        "https-private": "https://10.0.0.1/a.png",
        "https-ipv6-loopback": "https://[::1]/a.png",
        "https-unresolvable": "https://no-such-host.invalid/a.png",
        "file": "file:///etc/passwd",
        "ftp": "ftp://example.com/a.png",
        "gopher": "gopher://127.0.0.1:6379/_INFO",
        "javascript": "javascript:alert(1)",
        "relative": "/etc/passwd",
        "empty": "",
        "data-not-base64": "data:image/png,abc",
        "data-text-plain": f"data:text/plain;base64,{b64(b'hello')}",
        "data-bad-base64": "data:image/png;base64,@@@@",
        "data-no-comma": "data:image/png;base64",
    }
    for name, url in urls.items():
        yield f"url-{name}", chat(model, {"type": "image_url", "image_url": {"url": url}})


GENERATORS = (
    _pillow_formats,
    _sizes,
    _modes,
    _exif_and_animation,
    _truncations,
    _corrupt_pixels,
    _polyglots,
    _other_parts,
    _urls,
)


def corpus(model: str) -> list[Case]:
    cases = [case for generate in GENERATORS for case in generate(model)]
    names = [name for name, _ in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


def avif_available() -> bool:
    return bool(features.check("avif"))
