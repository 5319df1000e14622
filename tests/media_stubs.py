"""Media stubs shared by the tests and the hostile-request benchmarks: small real
headers that every sniffer reads, a PNG header declaring a huge image (a bomb), and
real images padded with empty container entries."""

from __future__ import annotations

import io
import struct
import zlib

from av_media import make_video
from PIL import Image


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A real PNG whose header declares width x height; pixel data is a tiny stub."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def png_of(
    width: int,
    height: int,
    raw: bytes,
    colour: int = 2,
    depth: int = 8,
    interlace: int = 0,
    tail: bytes = b"IEND",
) -> bytes:
    """A PNG of width x height whose one IDAT holds ``raw`` as given (already compressed,
    or not: the caller decides how wrong it is); ``tail``: the chunk kinds to end with."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    ending = b"".join(png_chunk(tail[i : i + 4], b"") for i in range(0, len(tail), 4))
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", raw) + ending


def png_rows(width: int, height: int, channels: int = 3, row_filter: int = 0) -> bytes:
    """Uncompressed 8-bit pixel rows (a pattern that does not compress to nothing), each
    behind its filter byte."""
    line = bytes((x * 7) % 251 for x in range(width * channels))
    return b"".join(bytes([row_filter]) + line[y % 3 :] + line[: y % 3] for y in range(height))


# A real two-frame 16x16 H.264 MP4 (PyAV), and a minimal real WAV: both whole files
# that FFmpeg reads to their end (``media.av_probe``).
MP4_BYTES = make_video("mp4", frames=2, width=16, height=16)
_WAV_SAMPLES = 1600  # 0.2 s at 8 kHz: long enough to make audio tokens
WAV_BYTES = (
    b"RIFF"
    + struct.pack("<I", 36 + 2 * _WAV_SAMPLES)
    + b"WAVEfmt "
    + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 16000, 2, 16)
    + b"data"
    + struct.pack("<I", 2 * _WAV_SAMPLES)
    + b"\x00" * (2 * _WAV_SAMPLES)
)
PDF_BYTES = b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n"


def _small(fmt: str, **options: object) -> bytes:
    """A real 32x32 image that does not compress to nothing (a gradient, a red block)."""
    image = Image.linear_gradient("L").resize((32, 32)).convert("RGB")
    image.paste((200, 30, 30), (0, 0, 10, 10))
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def jpeg_with(inserted: bytes) -> bytes:
    """A real JPEG with ``inserted`` after its first segment (the magic bytes stay whole)."""
    small = _small("JPEG")
    after = 4 + int.from_bytes(small[4:6], "big")
    return small[:after] + inserted + small[after:]


def png_with_chunks(count: int, before_image: bool = False) -> bytes:
    """A real PNG with ``count`` empty ancillary chunks (every CRC right) after its image
    data, or before it (after IHDR), where Pillow's header reader walks them too."""
    small = _small("PNG")
    at = 33 if before_image else len(small) - 12  # after IHDR, or before IEND
    return small[:at] + png_chunk(b"zzZz", b"") * count + small[at:]


def gif_with(inserted: bytes) -> bytes:
    """A real GIF with ``inserted`` where its first block starts (after the colour table)."""
    small = _small("GIF")
    table = 3 << ((small[10] & 7) + 1) if small[10] & 0x80 else 0
    first = 13 + table
    return small[:first] + inserted + small[first:]


def gif_with_sub_blocks(count: int) -> bytes:
    """A real GIF with a comment extension of ``count`` one-byte sub-blocks before its image."""
    return gif_with(b"\x21\xfe" + b"\x01a" * count + b"\x00")


def webp_with_chunks(count: int) -> bytes:
    """A real WebP with ``count`` empty unknown chunks after its bitstream."""
    chunks = _small("WEBP")[12:] + (b"ZZZZ" + bytes(4)) * count
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WEBP" + chunks


def padded_images(size: int) -> dict[str, tuple[str, bytes]]:
    """Real images padded to ~``size`` bytes with the emptiest entries each format allows:
    name -> (format, bytes)."""
    return {
        "jpeg comment segments": ("jpeg", jpeg_with(b"\xff\xfe\x00\x02" * (size // 4))),
        "jpeg fill bytes": ("jpeg", jpeg_with(b"\xff" * size)),
        "jpeg stray bytes": ("jpeg", jpeg_with(b"\x00" * size)),
        "png empty chunks": ("png", png_with_chunks(size // 12)),
        "gif one-byte sub-blocks": ("gif", gif_with_sub_blocks(size // 2)),
        "webp empty chunks": ("webp", webp_with_chunks(size // 8)),
    }
