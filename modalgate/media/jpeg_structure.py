"""Is a JPEG whole? Its segments and scans, walked without decoding.

The marker walk (SOI, segment lengths, one frame header, scans up to EOI) finds a
file cut inside a segment. A file cut inside the entropy-coded data with ``FFD9``
appended looks whole to it; three things still give it away without decoding:
restart markers (when the file declares an interval, their count is fixed by the
image size), progressive scans (every coefficient of every component must be sent
down to its last bit), and a floor on the data (a Huffman-coded block takes 2 bits
at least). A baseline JPEG without restart markers has none of these: only a full
decode (``verify_image_data``) finds it cut.

Segments and scans are counted (``walk_budget``): a file of empty segments, or of
thousands of tiny progressive scans, is refused before Pillow reads it.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from modalgate.media.walk_budget import (
    MAX_JPEG_SCANS,
    MAX_TIFF_DIRECTORY_ENTRIES,
    entry_budget,
    over_budget,
)


class JpegStructureError(ValueError):
    """The JPEG is cut short or malformed; the text is safe to show a client."""


def _truncated(detail: str = "") -> JpegStructureError:
    return JpegStructureError(f"the JPEG data is truncated{detail}")


def _corrupt(detail: str) -> JpegStructureError:
    return JpegStructureError(f"the JPEG data is corrupt ({detail})")


def _within(width: int, height: int, max_pixels: int | None) -> bool:
    return max_pixels is None or width * height <= max_pixels


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
# Markers libjpeg reads (jdmarker.c read_markers); any other stops it with an error
# ("Unsupported marker type"), which torchvision's decoder raises as a 500.
_KNOWN = frozenset({0x01, *range(0xC0, 0xD0), *range(0xD0, 0xDE), *range(0xE0, 0xF0), 0xFE}) - {
    0xC8
}
# In entropy-coded data 0xFF is followed by 0x00 (stuffing), RSTn or another 0xFF
# (fill); anything else is the marker that ends the scan.
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_RST = re.compile(rb"\xff[\xd0-\xd7]")
_RST_WINDOW = 64 * 1024  # markers listed a window at a time: memory stays flat
_NOT_FILL = re.compile(rb"[^\xff]")
# Real JPEGs have tens of segments (ICC profiles and XMP split in 64 KiB pieces, a DHT
# per progressive scan): the floor and one per 4 KiB is far above them.
BYTES_PER_SEGMENT = 4096
# Stray and fill bytes before a marker: libjpeg skips them with a warning, Pillow's
# header reader one at a time in Python. Some encoders leave a few hundred.
STRAY_BYTES = 1024
BYTES_PER_STRAY_BYTE = 1024
# What Pillow's header reader loops over inside one segment, in Python: Exif segments
# (concatenated, so quadratic), the tables of a DQT, Photoshop's resources (APP13).
MAX_EXIF_SEGMENTS = 4  # a file has one; the standard allows no continuation
MAX_DQT_BYTES = 2 + 4 * 129  # the four tables a baseline or progressive file can use
MAX_PHOTOSHOP_RESOURCES = 1024


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Frame:
    marker: int
    width: int
    height: int
    components: dict[int, tuple[int, int]]  # component id -> (h, v) sampling factors

    def scan_units(self, ids: list[int]) -> tuple[int, int]:
        """(MCUs, blocks) of one scan over ``ids`` (JPEG A.2: one component: its own blocks)."""
        hmax = max(h for h, _ in self.components.values())
        vmax = max(v for _, v in self.components.values())
        if len(ids) == 1:
            h, v = self.components[ids[0]]
            blocks = _ceil(_ceil(self.width * h, hmax), 8) * _ceil(_ceil(self.height * v, vmax), 8)
            return blocks, blocks
        mcus = _ceil(self.width, 8 * hmax) * _ceil(self.height, 8 * vmax)
        return mcus, mcus * sum(h * v for h, v in (self.components[i] for i in ids))


def walk_jpeg(data: bytes, max_pixels: int | None = None) -> None:
    """Walk every segment and scan of ``data`` (which starts with SOI); raise if it is not whole.

    The too-little-data floor applies only within ``max_pixels`` (see ``check_structure``).
    """
    size, pos = len(data), 2
    frame: _Frame | None = None
    restart = scans = 0
    segments = entry_budget(size, BYTES_PER_SEGMENT)  # each left to read
    stray = STRAY_BYTES + size // BYTES_PER_STRAY_BYTE
    exif, photoshop = MAX_EXIF_SEGMENTS, MAX_PHOTOSHOP_RESOURCES
    exif_spans: list[tuple[int, int]] = []  # Pillow joins them, then reads one TIFF
    scanned: set[int] = set()
    coverage: dict[int, list[int | None]] = {}  # progressive: lowest bit received, per coefficient
    while True:
        # Stray bytes and fill (0xFF) before a marker are skipped, as libjpeg does.
        found = data.find(b"\xff", pos)
        if found < 0:
            raise _truncated()
        marker_at = found + 1
        if marker_at < size and data[marker_at] == 0xFF:  # fill, searched no further than allowed
            allowed = marker_at + stray - (found - pos) + 1
            run_end = _NOT_FILL.search(data, marker_at, allowed)
            marker_at = run_end.start() if run_end else allowed
        if marker_at >= size:
            raise _truncated()
        stray -= marker_at - pos - 1
        segments -= 1
        if segments < 0 or stray < 0:
            what = "segments" if segments < 0 else "stray bytes between segments"
            raise _corrupt(over_budget(what, size))
        pos = marker_at
        marker = data[pos]
        pos += 1
        if marker == 0xD9:
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            continue
        if marker in (0x00, 0xD8):
            raise _corrupt("a misplaced marker")
        if marker not in _KNOWN:
            raise _corrupt(f"a marker decoders do not know (FF{marker:02X})")
        end = pos + int.from_bytes(data[pos : pos + 2], "big")
        if end < pos + 2 or pos + 2 > size:
            raise _truncated() if pos + 2 > size else _corrupt("a bad segment length")
        if end > size:
            raise _truncated()
        if marker == 0xE1 and data.startswith(b"Exif\x00\x00", pos + 2):
            exif -= 1
            if exif < 0:
                raise _corrupt(f"more than {MAX_EXIF_SEGMENTS} Exif segments")
            exif_spans.append((pos + 8, end))
        elif marker == 0xED:
            photoshop -= data.count(b"8BIM", pos + 2, end)
            if photoshop < 0:
                raise _corrupt(f"more than {MAX_PHOTOSHOP_RESOURCES} Photoshop resources")
        elif marker == 0xDB and end - pos > MAX_DQT_BYTES:
            raise _corrupt("a quantisation segment holds more tables than a JPEG uses")
        if marker in _SOF:
            if frame is not None:
                raise _corrupt("more than one frame header")
            frame = _jpeg_frame(data, marker, pos + 2, end)
            if marker in _PROGRESSIVE:
                coverage = {cid: [None] * 64 for cid in frame.components}
        elif marker == 0xDD and end - pos == 4:
            restart = int.from_bytes(data[pos + 2 : pos + 4], "big")
        elif marker == 0xDA:
            if frame is None:
                raise _corrupt("a scan before the frame header")
            scans += 1
            if scans > MAX_JPEG_SCANS:
                raise _corrupt(f"more than {MAX_JPEG_SCANS} scans")
            ids = set(data[pos + 3 : end - 3 : 2])
            # The data is searched to its end (~0.3 ms per MB): a marker inside it that
            # libjpeg does not know is an error there, not a warning.
            found = _SCAN_END.search(data, end)
            scan_end = found.start() if found else -1
            if scan_end < 0:
                raise _truncated()
            _jpeg_scan(data, frame, (pos + 2, end, scan_end), restart, coverage, max_pixels)
            scanned.update(ids)
            pos = scan_end
            continue
        pos = end
    if exif_spans:
        _check_exif_directory(b"".join(data[start:stop] for start, stop in exif_spans))
    if frame is None or not scanned:
        raise _corrupt("no image data")
    whole = all(bit == 0 for bits in coverage.values() for bit in bits)
    if frame.height and not (scanned >= frame.components.keys() and whole):
        raise _truncated(": its scans stop before every component is complete")


def _restart_markers(data: bytes, start: int, end: int, needed: int) -> bool:
    """Whether data[start:end] holds ``needed`` restart markers. Listed a window at a
    time, and no further than needed: a list of them all would hold ~40 bytes of memory
    per 2 sent. Windows overlap by a byte, so a marker across their edge counts once."""
    found = 0
    for at in range(start, end, _RST_WINDOW):
        found += len(_RST.findall(data, at, min(at + _RST_WINDOW + 1, end)))
        if found >= needed:
            return True
    return found >= needed


def _check_exif_directory(tiff: bytes) -> None:
    """The Exif segments joined, as Pillow joins them: its first directory is read tag
    by tag, and, as in a TIFF, one of more than ``MAX_TIFF_DIRECTORY_ENTRIES`` is refused."""
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return  # not one Pillow reads as TIFF: nothing it loops over
    directory = struct.unpack_from(order + "I", tiff, 4)[0]
    if directory + 2 <= len(tiff):
        count = struct.unpack_from(order + "H", tiff, directory)[0]
        if count > MAX_TIFF_DIRECTORY_ENTRIES:
            raise _corrupt(f"an Exif directory of {count} entries")


def _jpeg_frame(data: bytes, marker: int, start: int, end: int) -> _Frame:
    count = data[start + 5] if end - start >= 6 else 0
    if count == 0 or end - start != 6 + 3 * count:
        raise _corrupt("the frame header is malformed")
    height, width = struct.unpack_from(">HH", data, start + 1)
    components = {}
    for at in range(start + 6, end, 3):
        h, v = data[at + 1] >> 4, data[at + 1] & 15
        if not (1 <= h <= 4 and 1 <= v <= 4) or width == 0:
            raise _corrupt("the frame header is malformed")
        components[data[at]] = (h, v)
    return _Frame(marker, width, height, components)


def _jpeg_scan(
    data: bytes,
    frame: _Frame,
    at: tuple[int, int, int],
    restart: int,
    coverage: dict[int, list[int | None]],
    max_pixels: int | None,
) -> None:
    """One scan: its header, its restart markers, and a floor on its entropy-coded size.

    ``at``: where the scan header starts and ends, and where its entropy-coded data ends.
    """
    start, end, scan_end = at
    count = data[start] if start < end else 0
    if count == 0 or end - start != 4 + 2 * count:
        raise _corrupt("a scan header is malformed")
    ids = list(data[start + 1 : end - 3 : 2])
    if not frame.components.keys() >= set(ids):
        raise _corrupt("a scan names an unknown component")
    ss, se, ah, al = data[end - 3], data[end - 2], data[end - 1] >> 4, data[end - 1] & 15
    for cid in ids if coverage else ():
        bits = coverage[cid]
        for k in range(ss, min(se, 63) + 1):
            if (ah == 0 and bits[k] is None) or (ah and bits[k] == ah):
                bits[k] = al
    if not frame.height:  # the height comes later, in a DNL segment: nothing to count
        return
    mcus, blocks = frame.scan_units(ids)
    if restart and not _restart_markers(data, end, scan_end, _ceil(mcus, restart) - 1):
        raise _truncated(": restart markers are missing")
    # Huffman codes are 1 bit at least: sequential blocks need a DC code and an EOB,
    # progressive DC scans one bit a block.
    floor = 2 if frame.marker in (0xC0, 0xC1) else int(frame.marker == 0xC2 and ss == 0)
    if (scan_end - end) * 8 < blocks * floor and _within(frame.width, frame.height, max_pixels):
        raise _truncated(f": too little scan data for a {frame.width}x{frame.height} image")
