"""Is the file whole? Structural walks of image containers, with bounded frame counts.

A header that parses says nothing about the rest of the file: a PNG cut in half
with an ``IEND`` chunk glued on, or a JPEG cut in half with ``FFD9`` appended,
used to pass, and Pillow's frame count seeks through every frame of a GIF in
Python (seconds for a few hundred thousand tiny frames). These walks read
container structure only (chunk lengths and CRCs, JPEG markers and scan headers,
GIF block chains, RIFF chunks, TIFF IFDs; JPEG in ``media.jpeg_structure``):
about a millisecond per megabyte, no pixel decoded, and frame counting stops one
frame past the caller's limit.

A PNG's pixel data is inflated too (``media.png_pixels``): a decoder that meets a
corrupt or short zlib stream or a bad row filter may kill its process. What a walk
cannot see in other formats (the entropy-coded data of a baseline JPEG cut at a
byte, which libjpeg finishes in grey) needs a full decode; ``media.decode`` offers
that as policy (``verify_image_data``).

Every walk counts the entries it reads against a budget for the file's size
(``walk_budget``): a container padded with empty entries is refused within about
ten times what a real image of its size costs (``benchmarks/p10_padded_images.py``).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from zlib_ng import zlib_ng as zlib  # crc32 ~4x the standard library's, same values

from modalgate.media.jpeg_structure import JpegStructureError, walk_jpeg
from modalgate.media.png_pixels import PngPixelError, check_stream, raw_size
from modalgate.media.walk_budget import (
    ENTRIES_PER_FRAME,
    MAX_TIFF_DIRECTORY_ENTRIES,
    entry_budget,
    over_budget,
)


class ImageIntegrityError(ValueError):
    """The bytes cannot be a whole image; the text is safe to show a client."""


@dataclass(frozen=True, slots=True)
class Structure:
    frames: int  # frames counted: at most frame_limit + 1
    capped: bool = False  # counting stopped early, so ``frames`` is a lower bound


# Bytes per entry the budgets allow: libpng writes 8 KiB IDAT chunks, GIF encoders
# 255-byte sub-blocks; a WebP holds a few chunks, or a few per frame.
BYTES_PER_PNG_CHUNK = 1024
BYTES_PER_GIF_SUB_BLOCK = 64  # XMP kept as GIF "sub-blocks" hops ~60-100 bytes a step
BYTES_PER_RIFF_CHUNK = 1024
# Pillow reads every chunk before the first IDAT in Python (~3 us each, an exception for
# each unknown one); encoders write a few (iCCP, pHYs, text): past this, none would.
PNG_CHUNKS_BEFORE_IMAGE = 64
# Pillow inflates each of these (up to 1 MiB apiece) when it reads the header or the
# pixels; encoders write one iCCP and a few text profiles.
PNG_COMPRESSED_CHUNKS = frozenset({b"zTXt", b"iTXt", b"iCCP"})  # iTXt: where its flag says
MAX_PNG_COMPRESSED_CHUNKS = 8

# Deflate's best case is 258 bytes from 2 bits (1032:1); less data than that cannot
# hold the declared pixels.
DEFLATE_MAX_RATIO = 1032


def check_structure(
    data: bytes, fmt: str, frame_limit: int = 1, max_pixels: int | None = None
) -> Structure | None:
    """Walk ``data`` (magic bytes said ``fmt``); ``None`` where there is no walker for it.

    Frames are counted up to ``frame_limit + 1``. The data-size bounds (too little
    data for the declared pixels) apply only to images within ``max_pixels``: a
    bigger one is refused for its size by the caller, with a clearer message.
    """
    walker = _WALKERS.get(fmt)
    if walker is None:
        return None
    try:
        return walker(data, max(1, frame_limit), max_pixels)
    except (IndexError, struct.error):  # a field read past the end: a walk that missed a check
        raise _truncated(fmt.upper()) from None


def _truncated(fmt: str, detail: str = "") -> ImageIntegrityError:
    return ImageIntegrityError(f"the {fmt} data is truncated{detail}")


def _corrupt(fmt: str, detail: str) -> ImageIntegrityError:
    return ImageIntegrityError(f"the {fmt} data is corrupt ({detail})")


def _within(width: int, height: int, max_pixels: int | None) -> bool:
    return max_pixels is None or width * height <= max_pixels


# ---------------------------------------------------------------- PNG

_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"


@dataclass(slots=True)
class PngLayout:
    """Where a PNG's zlib streams are: one per frame, as (width, height, chunk data spans)."""

    colour: int
    bits_per_pixel: int
    interlaced: bool
    streams: list[tuple[int, int, list[tuple[int, int]]]]


def _png(data: bytes, frame_limit: int, max_pixels: int | None) -> Structure:
    """The walk, then every counted frame's pixel data inflated (``png_pixels``)."""
    layout, structure = _png_walk(data, frame_limit, max_pixels)
    if structure.capped:  # refused for its frames by the caller
        return structure
    for width, height, spans in layout.streams:
        if not _within(width, height, max_pixels):
            break  # refused for its size by the caller
        try:
            check_stream(data, spans, width, height, layout.bits_per_pixel, layout.interlaced)
        except PngPixelError as exc:
            raise ImageIntegrityError(str(exc)) from None
    return structure


def _png_walk(data: bytes, frame_limit: int, max_pixels: int | None) -> tuple[PngLayout, Structure]:
    size, view, pos = len(data), memoryview(data), 8
    layout: PngLayout | None = None
    idat_total, idat_run, declared, fctl, palette = 0, 0, None, 0, False
    default_in_animation = False  # an fcTL before the IDAT: the image is the first frame
    spans: list[tuple[int, int]] = []
    budget = entry_budget(size, BYTES_PER_PNG_CHUNK)
    ahead, compressed = PNG_CHUNKS_BEFORE_IMAGE, MAX_PNG_COMPRESSED_CHUNKS
    while True:
        budget -= 1
        if budget < 0:
            raise _corrupt("PNG", over_budget("chunks", size))
        if size - pos < 12 and idat_run and _IEND.startswith(data[pos:]):
            break  # only IEND is missing, or cut: decoders (libpng, Pillow) finish such a file
        if pos + 12 > size:
            raise _truncated("PNG")
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if length > 0x7FFFFFFF or not kind.isalpha():
            raise _corrupt("PNG", "a chunk header is malformed")
        if end > size:
            raise _truncated("PNG")
        if zlib.crc32(view[pos + 4 : end - 4]) != int.from_bytes(data[end - 4 : end], "big"):
            raise _corrupt("PNG", "a chunk fails its checksum")
        body = pos + 8
        if layout is None:
            if kind != b"IHDR" or length != 13:
                raise _corrupt("PNG", "the first chunk is not IHDR")
            layout, width, height = _png_header(data, body)
        elif kind == b"IHDR":
            raise _corrupt("PNG", "a second IHDR chunk")
        if idat_total == 0 and kind != b"IDAT":
            ahead -= 1
            if ahead < 0:
                raise _corrupt(
                    "PNG", f"over {PNG_CHUNKS_BEFORE_IMAGE} chunks before the image data"
                )
        if kind in PNG_COMPRESSED_CHUNKS and (kind != b"iTXt" or _itxt_compressed(data, body, end)):
            compressed -= 1
            if compressed < 0:
                raise _corrupt(
                    "PNG", f"over {MAX_PNG_COMPRESSED_CHUNKS} compressed text or profile chunks"
                )
        if kind == b"IDAT":
            if idat_run == 2:
                raise _corrupt("PNG", "IDAT chunks are not contiguous")
            if idat_run == 0:
                spans = []
                layout.streams.append((width, height, spans))
            idat_run, idat_total = 1, idat_total + length
            spans.append((body, length))
        elif idat_run == 1:
            idat_run, spans = 2, []  # fdAT before a frame's fcTL lands nowhere
        if kind == b"IEND":
            pos = end
            break
        if kind == b"PLTE":
            palette = True
        elif kind == b"acTL" and length == 8 and idat_run == 0:
            declared = int.from_bytes(data[body : body + 4], "big")
        elif kind == b"fcTL" and length == 26 and declared is not None:
            fctl, budget = fctl + 1, budget + ENTRIES_PER_FRAME
            default_in_animation = default_in_animation or idat_run == 0
            # A default image outside the animation is one more frame (Pillow's n_frames).
            if fctl + (not default_in_animation) > frame_limit:
                return layout, Structure(fctl + (not default_in_animation), capped=True)
            spans = []
            fw, fh, fx, fy = struct.unpack_from(">IIII", data, body + 4)
            if not (fw > 0 and fh > 0 and fx + fw <= width and fy + fh <= height):
                raise _corrupt("PNG", "an animation frame lies outside the image")  # as Pillow
            if idat_run == 0 and (fw, fh) != (width, height):
                raise _corrupt("PNG", "the first frame's size is not the image's")
            if idat_run == 2:  # frames after the default image keep their data in fdAT
                layout.streams.append((fw, fh, spans))
        elif kind == b"fdAT" and length >= 4:
            spans.append((body + 4, length - 4))
        pos = end
    assert layout is not None
    if data.count(0, pos) != size - pos and not (size - pos < 12 and _IEND.startswith(data[pos:])):
        raise _corrupt("PNG", "data follows the IEND chunk")
    if idat_total == 0:
        raise _corrupt("PNG", "no IDAT chunk")
    if layout.colour == 3 and not palette:
        raise _corrupt("PNG", "a palette image without PLTE")
    if declared is not None and declared != fctl:
        raise _truncated("PNG", f": the animation declares {declared} frames but holds {fctl}")
    raw = raw_size(width, height, layout.bits_per_pixel, layout.interlaced)
    if _within(width, height, max_pixels) and idat_total * DEFLATE_MAX_RATIO + 1024 < raw:
        raise _truncated(
            "PNG", f": {idat_total} bytes of pixel data cannot hold a {width}x{height} image"
        )
    return layout, Structure(max(1, fctl + (fctl > 0 and not default_in_animation)))


def _itxt_compressed(data: bytes, body: int, end: int) -> bool:
    """Whether an iTXt chunk's text is compressed: the flag after its keyword, found as
    Pillow finds it (the first zero byte, however long the keyword). ``end``: the chunk's
    end, its CRC included."""
    nul = data.find(b"\x00", body, end - 4)
    return nul >= 0 and nul + 1 < end - 4 and data[nul + 1] != 0


def _png_header(data: bytes, body: int) -> tuple[PngLayout, int, int]:
    width, height, depth, colour, compression, filtering, interlace = struct.unpack_from(
        ">IIBBBBB", data, body
    )
    if not (0 < width <= 0x7FFFFFFF and 0 < height <= 0x7FFFFFFF):
        raise _corrupt("PNG", "IHDR declares an empty image")
    if depth not in _PNG_DEPTHS.get(colour, ()) or compression or filtering or interlace > 1:
        raise _corrupt("PNG", "IHDR has invalid fields")
    return PngLayout(colour, depth * _PNG_CHANNELS[colour], interlace == 1, []), width, height


def _jpeg(data: bytes, frame_limit: int, max_pixels: int | None) -> Structure:
    try:
        walk_jpeg(data, max_pixels)
    except JpegStructureError as exc:
        raise ImageIntegrityError(str(exc)) from None
    return Structure(1)  # one frame: MPO's extra pictures are not frames to Pillow's JPEG plugin


# ---------------------------------------------------------------- GIF


_GIF_BLOCK = re.compile(rb"[!,;]")


def _colour_table(flags: int) -> int:
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _sub_blocks(data: bytes, pos: int, left: int) -> tuple[int, int]:
    """The position after a chain of sub-blocks (length byte, bytes; a zero length ends
    it), and how many of the walk's ``left`` entries remain (negative: over budget)."""
    size = len(data)
    while pos < size and left >= 0:
        length = data[pos]
        pos += length + 1
        left -= 1
        if length == 0:
            return pos, left
    if left < 0:
        return pos, left
    raise _truncated("GIF")


def _gif(data: bytes, frame_limit: int, max_pixels: int | None) -> Structure:
    size, frames = len(data), 0
    if size < 13:
        raise _truncated("GIF")
    left = entry_budget(size, BYTES_PER_GIF_SUB_BLOCK)
    pos = 13 + _colour_table(data[10])
    while True:
        if left < 0:
            raise _corrupt("GIF", over_budget("blocks", size))
        if pos >= size:
            raise _truncated("GIF", ": no trailer")
        block = data[pos]
        if block == 0x3B:
            break
        if block == 0x21:  # extension: label, then sub-blocks
            pos, left = _sub_blocks(data, pos + 2, left - 1)
        elif block == 0x2C:  # image: descriptor, local colour table, LZW code size, data
            frames, left = frames + 1, left + ENTRIES_PER_FRAME
            if frames > frame_limit:
                return Structure(frames, capped=True)
            if pos + 10 > size:
                raise _truncated("GIF")
            pos, left = _sub_blocks(data, pos + 11 + _colour_table(data[pos + 9]), left - 1)
        else:  # stray bytes between blocks: Pillow skips them too, one at a time
            found = _GIF_BLOCK.search(data, pos, pos + left + 1)
            skipped_to = found.start() if found else min(size, pos + left + 1)
            pos, left = skipped_to, left - (skipped_to - pos)
    if frames == 0:
        raise _corrupt("GIF", "no image")
    return Structure(frames)


# ---------------------------------------------------------------- WebP


def _riff_chunks(data: bytes, pos: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(fourcc, start, end) of the chunks in data[pos:end], one at a time; odd sizes
    carry a pad byte."""
    while pos + 8 <= end:
        kind, length = struct.unpack_from("<4sI", data, pos)
        if pos + 8 + length > end:
            raise _truncated("WebP")
        yield kind, pos + 8, pos + 8 + length
        pos += 8 + length + (length & 1)
    if pos < end:
        raise _truncated("WebP")


def _webp_image(data: bytes, chunks: list[tuple[bytes, int, int]]) -> bool:
    """Whether ``chunks`` hold a bitstream; raises if its own header says it is cut short."""
    found = False
    for kind, start, end in chunks:
        if kind == b"VP8 ":
            tag = int.from_bytes(data[start : start + 3], "little") if end - start >= 10 else 1
            if tag & 1 or data[start + 3 : start + 6] != b"\x9d\x01\x2a":
                raise _corrupt("WebP", "a bad VP8 frame header")
            if 10 + (tag >> 5) > end - start:
                raise _truncated("WebP")
        elif kind == b"VP8L" and (end - start < 5 or data[start] != 0x2F):
            raise _corrupt("WebP", "a bad VP8L header")
        found = found or kind in (b"VP8 ", b"VP8L")
    return found


def _webp(data: bytes, frame_limit: int, max_pixels: int | None) -> Structure:
    riff_end = 8 + int.from_bytes(data[4:8], "little")
    if len(data) < 20 or riff_end > len(data):
        raise _truncated("WebP")
    left = entry_budget(len(data), BYTES_PER_RIFF_CHUNK)
    chunks: list[tuple[bytes, int, int]] = []
    frames = 0
    for chunk in _riff_chunks(data, 12, riff_end):
        kind, start, end = chunk
        chunks.append(chunk)
        left -= 1
        if kind == b"ANMF":  # counted as it comes: the walk stops one frame past the limit
            frames, left = frames + 1, left + ENTRIES_PER_FRAME
            if frames > frame_limit:
                return Structure(frames, capped=True)
            inner = list(islice(_riff_chunks(data, start + 16, end), max(left, 0) + 1))
            left -= len(inner)
            if left >= 0 and (end - start < 16 or not _webp_image(data, inner)):
                raise _corrupt("WebP", "an animation frame without image data")
        if left < 0:
            raise _corrupt("WebP", over_budget("chunks", len(data)))
    if not _webp_image(data, chunks) and frames == 0:
        raise _corrupt("WebP", "no image data")
    return Structure(max(frames, 1))


# ---------------------------------------------------------------- TIFF


def _tiff_values(data: bytes, order: str, kind: int, count: int, at: int) -> tuple[int, ...]:
    code, width = {3: ("H", 2), 4: ("I", 4)}.get(kind, ("", 0))
    if not code or count > len(data):
        return ()
    if count * width > 4:
        at = struct.unpack_from(order + "I", data, at)[0]
    if at + count * width > len(data):
        raise _truncated("TIFF")
    return struct.unpack_from(f"{order}{count}{code}", data, at)


def _tiff(data: bytes, frame_limit: int, max_pixels: int | None) -> Structure:
    """Walk the IFD chain (bounded, loops refused); strips and tiles must lie inside the file."""
    size, order = len(data), "<" if data[:2] == b"II" else ">"
    offset = struct.unpack_from(order + "I", data, 4)[0] if size >= 8 else 0
    frames, seen = 0, set()
    while offset:
        if offset in seen or offset < 8:
            raise _corrupt("TIFF", "a bad directory offset")
        seen.add(offset)
        count = struct.unpack_from(order + "H", data, offset)[0] if offset + 2 <= size else 0
        if count > MAX_TIFF_DIRECTORY_ENTRIES:  # each a step here and in Pillow's reader
            raise _corrupt("TIFF", f"a directory of {count} entries")
        after = offset + 2 + 12 * count
        if offset + 2 > size or after + 4 > size:
            raise _truncated("TIFF")
        frames += 1
        if frames > frame_limit:
            return Structure(frames, capped=True)
        tags = {
            tag: (kind, n, offset + 2 + 12 * i + 8)
            for i, (tag, kind, n, _) in enumerate(
                struct.iter_unpack(order + "HHII", data[offset + 2 : after])
            )
            if tag in (273, 279, 324, 325)
        }
        for where, length in ((273, 279), (324, 325)):
            if where in tags and length in tags:
                spans = zip(
                    _tiff_values(data, order, *tags[where]),
                    _tiff_values(data, order, *tags[length]),
                    strict=False,
                )
                if any(start + n > size for start, n in spans):
                    raise _truncated("TIFF")
        offset = struct.unpack_from(order + "I", data, after)[0]
    if frames == 0:
        raise _corrupt("TIFF", "no image directory")
    return Structure(frames)


_WALKERS = {"png": _png, "jpeg": _jpeg, "gif": _gif, "webp": _webp, "tiff": _tiff}
