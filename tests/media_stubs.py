"""Media stubs shared by the tests and the hostile-request benchmarks: small real
headers that every sniffer reads, and a PNG header declaring a huge image (a bomb)."""

from __future__ import annotations

import struct
import zlib


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A real PNG whose header declares width x height; pixel data is a tiny stub."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


# Minimal real container headers (enough for every sniffer, ffprobe included).
MP4_BYTES = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00\x00\x00\x08free" * 4
WAV_BYTES = (
    b"RIFF"
    + struct.pack("<I", 36 + 8)
    + b"WAVEfmt "
    + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 16000, 2, 16)
    + b"data"
    + struct.pack("<I", 8)
    + b"\x00" * 8
)
PDF_BYTES = b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n"
