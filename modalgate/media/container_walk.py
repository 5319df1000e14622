"""Is a video or audio file whole? Its outermost structure, walked to its last byte.

FFmpeg's demuxers forgive: a file cut inside its last box, cluster or page, or
followed by another file, is read as far as it goes, and what it declares is
recomputed from what is left. A server loads it the same way, or fails on it, or
reads the other file's bytes: the gate does not guess which. Each container
that says how long it is is walked here at the level that says so (ISO BMFF
top-level boxes, the RIFF chunk, the EBML Segment, Ogg pages, MPEG-TS packets) and
must end where it says, at the end of the data. MP3, ADTS AAC and FLAC are bare
streams of frames with no length here to check (FLAC's metadata blocks are walked,
as libFLAC parses them): one cut between frames plays shorter, as decoders play it;
one cut inside its last frame, or with bytes between two frames, is refused by
``av_probe``.
"""

from __future__ import annotations

import struct

# Top-level boxes, Ogg pages: counted, so a file of millions of tiny ones costs a bounded walk.
MAX_BOXES = 1 << 16
MAX_OGG_PAGES = 1 << 20
_TS_PACKET = 188
_EBML_UNKNOWN_SIZES = frozenset((1 << (7 * n)) - 1 for n in range(1, 9))


def end_problem(data: bytes, fmt: str) -> str | None:
    """Why ``data`` is not a whole ``fmt`` file (cut short, or more after its end); None
    where it is, or where the format has no length to check."""
    walk = _WALKS.get(fmt)
    return walk(data) if walk is not None else None


def _iso_boxes(data: bytes) -> str | None:
    at, boxes, kinds = 0, 0, set()
    while at < len(data):
        if len(data) - at < 8:
            return "it is cut short (inside a box header)"
        size, kind = struct.unpack_from(">I4s", data, at)
        header = 8
        if size == 1:
            if len(data) - at < 16:
                return "it is cut short (inside a box header)"
            (size,) = struct.unpack_from(">Q", data, at + 8)
            header = 16
        elif size == 0:  # the last box runs to the end of the file
            size = len(data) - at
        if size < header:
            return f"its {_box_name(kind)} box has an impossible size"
        kinds.add(kind)
        at += size
        boxes += 1
        if boxes > MAX_BOXES:
            return "it has too many top-level boxes"
    if at > len(data):
        return f"it is cut short (its last box, {_box_name(kind)}, ends past the data)"
    if b"moov" not in kinds:
        return "it has no movie header (moov box)"
    return None


def _box_name(kind: bytes) -> str:
    return kind.decode("latin-1") if kind.isalnum() else "?"


def _riff(data: bytes) -> str | None:
    if len(data) < 12:
        return "it is cut short (inside its RIFF header)"
    (size,) = struct.unpack_from("<I", data, 4)
    if size in (0, 0xFFFFFFFF):  # written to a pipe: the length was never filled in
        return None
    end = 8 + size
    if end > len(data):
        return "it is cut short (its RIFF chunk ends past the data)"
    if len(data) > end + (size & 1):  # an odd-sized chunk may be padded with one byte
        return "there is more data after its end"
    return None


def _ebml(data: bytes) -> str | None:
    at = 0
    for expected in (0x1A45DFA3, 0x18538067):  # the EBML header, then the Segment
        element = _ebml_element(data, at)
        if element is None:
            return "it is cut short (inside an element header)"
        element_id, size, body = element
        if element_id != expected:
            return "it has no Segment after its EBML header"
        if size in _EBML_UNKNOWN_SIZES and expected == 0x18538067:
            return None  # a live stream: its Segment runs to the end, by definition
        at = body + size
    if at > len(data):
        return "it is cut short (its Segment ends past the data)"
    if at < len(data):
        return "there is more data after its end"
    return None


def _ebml_element(data: bytes, at: int) -> tuple[int, int, int] | None:
    """(ID, size, where the body starts) of the element at ``at``; None: cut short."""
    element_id = _vint(data, at, keep_marker=True)
    if element_id is None:
        return None
    value, width = element_id
    size = _vint(data, at + width, keep_marker=False)
    if size is None:
        return None
    return value, size[0], at + width + size[1]


def _vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int] | None:
    if at >= len(data) or data[at] == 0:
        return None
    width = 9 - data[at].bit_length()
    if at + width > len(data):
        return None
    value = int.from_bytes(data[at : at + width], "big")
    if not keep_marker:
        value &= (1 << (7 * width)) - 1
    return value, width


def _ogg_pages(data: bytes) -> str | None:
    return _ogg_walk(data)[0]


def ogg_final_granule(data: bytes) -> int | None:
    """The granule position of a whole Ogg file's last page (None where it is not whole)."""
    problem, last = _ogg_walk(data)
    return None if problem is not None else struct.unpack_from("<q", data, last + 6)[0]


def _ogg_walk(data: bytes) -> tuple[str | None, int]:
    """Why the pages do not end the data, or None; and where the last page starts."""
    at, pages, last_flags, last = 0, 0, 0, 0
    while at < len(data):
        if data[at : at + 4] != b"OggS":
            return "it is cut short or damaged (a page does not start where the last ended)", last
        if len(data) - at < 27:
            return "it is cut short (inside a page header)", last
        segments = data[at + 26]
        table = data[at + 27 : at + 27 + segments]
        if len(table) < segments:
            return "it is cut short (inside a page header)", last
        last_flags, last = data[at + 5], at
        at += 27 + segments + sum(table)
        pages += 1
        if pages > MAX_OGG_PAGES:
            return "it has too many pages", last
    if at > len(data):
        return "it is cut short (its last page ends past the data)", last
    if not last_flags & 0x04:
        return "it is cut short (its last page is not the end of its stream)", last
    return None, last


def _transport_stream(data: bytes) -> str | None:
    if len(data) % _TS_PACKET:
        return "it is cut short (inside a transport stream packet)"
    return None


def _flac_metadata(data: bytes) -> str | None:
    """FLAC's metadata blocks, each as long as it says (a Vorbis comment block down to
    its strings, which libFLAC parses and FFmpeg skips), then the first frame's sync."""
    at, last = 4, False
    for index in range(MAX_BOXES):
        if len(data) - at < 4:
            return "it is cut short (inside its metadata)"
        kind, length = data[at] & 0x7F, int.from_bytes(data[at + 1 : at + 4], "big")
        last, at = bool(data[at] & 0x80), at + 4
        if at + length > len(data):
            return "it is cut short (inside its metadata)"
        if (index == 0) != (kind == 0) or (kind == 0 and length != 34) or kind == 127:
            return "its metadata is damaged (STREAMINFO is not its first block)"
        if kind == 4 and not _vorbis_comment_fits(data[at : at + length]):
            return "its metadata is damaged (a comment's length is false)"
        at += length
        if last:
            break
    if not last:
        return "it has too many metadata blocks"
    if len(data) - at < 2 or data[at] != 0xFF or data[at + 1] & 0xFE != 0xF8:
        return "it is damaged (no frame follows its metadata)"
    return None


def _vorbis_comment_fits(block: bytes) -> bool:
    """Vendor string, then a count of strings: each length-prefixed, filling the block."""
    if len(block) < 8:
        return False
    at = 4 + int.from_bytes(block[:4], "little")
    if at + 4 > len(block):
        return False
    count, at = int.from_bytes(block[at : at + 4], "little"), at + 4
    if count > (len(block) - at) // 4:
        return False
    for _ in range(count):
        if at + 4 > len(block):
            return False
        at += 4 + int.from_bytes(block[at : at + 4], "little")
    return at == len(block)


_WALKS = {
    "flac": _flac_metadata,
    "mp4": _iso_boxes,
    "mov": _iso_boxes,
    "m4a": _iso_boxes,
    "wav": _riff,
    "avi": _riff,
    "webm": _ebml,
    "mkv": _ebml,
    "ogg": _ogg_pages,
    "ogv": _ogg_pages,
    "ts": _transport_stream,
}
