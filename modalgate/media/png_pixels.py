"""Is a PNG's pixel data whole? Each zlib stream inflated, its rows counted and their filters read.

A PNG whose chunks are all intact can still hold pixel data no decoder finishes: a
zlib stream that is corrupt or stops early, a row short, a row whose filter byte is
not one of the five PNG defines. libpng stops with an error on each, and servers
react badly: torchvision's decoder (which ``transformers serve`` loads images with)
kills the whole process on them, at 32x32 as at 4000x3000. So every stream is
inflated here, streamed and counted, never kept: it must hold at least the rows
IHDR (or the frame's fcTL) promises, every row must start with a filter byte of
0-4, and the stream must end, with no damage up to its end: a stream without its
final block or with a bad Adler-32 killed ``transformers serve`` however many rows
it held (the real-server differential, ``tests/realserver``). A few extra rows pass: libpng calls
"too much image data" benign, Pillow stops at the last row, and the real-server
differential (``tests/realserver``) saw ``transformers serve`` answer 200 to them.

The work is the inflated size (up to ~1,000 times the compressed size), so it is
charged to ``inline_work`` first: a small body with a big declared image is judged
in a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator

# zlib-ng: the same format, checks and errors as zlib, and inflates a flat 7168^2 image's
# 154 MB of rows in ~14 ms against zlib's ~116 ms (benchmarks/png_pixel_check.py).
from zlib_ng import zlib_ng as zlib

from modalgate.media.inline_work import charge

_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2))
_ADAM7 += ((0, 1, 1, 2),)  # (x0, y0, dx, dy) of the seven passes
_FILTERS = bytes(range(5))  # None, Sub, Up, Average, Paeth
_FEED, _OUT = 1 << 16, 1 << 20  # bytes of input per call, most bytes of output per call
# Inflated bytes past the last row still read (and accepted, as decoders accept them):
# encoders write none; past this the stream is refused rather than inflated on.
EXTRA_ROW_BYTES = 1 << 16


class PngPixelError(ValueError):
    """The pixel data cannot be decoded to its end; the text is safe to show a client."""


def row_runs(
    width: int, height: int, bits_per_pixel: int, interlaced: bool
) -> list[tuple[int, int]]:
    """The stream's rows as runs of (count, stride): one run, or one per non-empty Adam7
    pass; a stride is one filter byte plus the row's packed samples."""
    if not interlaced:
        passes = [(width, height)]
    else:
        passes = [
            ((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7
        ]
    return [(h, 1 + (w * bits_per_pixel + 7) // 8) for w, h in passes if w > 0 and h > 0]


def raw_size(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> int:
    """Inflated size of the pixel data."""
    return sum(
        rows * stride for rows, stride in row_runs(width, height, bits_per_pixel, interlaced)
    )


def check_stream(
    data: bytes,
    spans: list[tuple[int, int]],
    width: int,
    height: int,
    bits_per_pixel: int,
    interlaced: bool,
) -> None:
    """Inflate the zlib stream kept in ``data`` at ``spans`` ((start, length) of each
    chunk's share) and check it against the image it must hold; raise PngPixelError."""
    runs = row_runs(width, height, bits_per_pixel, interlaced)
    expected = sum(rows * stride for rows, stride in runs)
    charge(expected)
    rows = _RowFilters(runs)
    stream = zlib.decompressobj()
    try:
        for chunk in _inflated(stream, memoryview(data), spans, expected + EXTRA_ROW_BYTES + 1):
            rows.check(chunk)
    except zlib.error:
        raise PngPixelError("the PNG image data is corrupt (its zlib stream is damaged)") from None
    if rows.seen < expected:
        raise PngPixelError("the PNG image data is truncated (fewer rows than its header says)")
    if rows.seen > expected + EXTRA_ROW_BYTES:
        raise PngPixelError("the PNG image data is longer than its header says")
    if not stream.eof:  # every row there, but no final block: libpng fails on it
        raise PngPixelError("the PNG image data is truncated (its zlib stream does not end)")


def _inflated(
    stream: zlib._Decompress, view: memoryview, spans: list[tuple[int, int]], expected: int
) -> Iterator[bytes]:
    """The stream's output, a bounded piece at a time, until its end or ``expected`` bytes
    (no input is read past what those need)."""
    produced = 0
    for start, length in spans:
        for at in range(start, start + length, _FEED):
            pending = view[at : min(at + _FEED, start + length)]
            while pending and not stream.eof and produced < expected:
                # Never past the last row: zlib reads no input beyond what that needs.
                out = stream.decompress(pending, min(_OUT, expected - produced))
                produced += len(out)
                yield out
                pending = stream.unconsumed_tail
            if stream.eof or produced >= expected:
                return
    while not stream.eof and produced < expected:
        out = stream.decompress(b"", min(_OUT, expected - produced))
        if not out:
            return
        produced += len(out)
        yield out


class _RowFilters:
    """Reads the filter byte at the start of every row as the output goes by."""

    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self._runs = iter(runs)
        self._left, self._stride = next(self._runs, (0, 0))
        self._next = 0  # offset in the stream of the next filter byte
        self.seen = 0  # bytes of output so far

    def check(self, chunk: bytes) -> None:
        end = self.seen + len(chunk)
        while self._left and self._next < end:
            at = self._next - self.seen
            rows = min(self._left, (len(chunk) - at + self._stride - 1) // self._stride)
            filters = chunk[at : at + (rows - 1) * self._stride + 1 : self._stride]
            if filters.translate(None, _FILTERS):
                raise PngPixelError("the PNG image data is corrupt (a row has an invalid filter)")
            self._left -= rows
            self._next += rows * self._stride
            if not self._left:
                self._left, self._stride = next(self._runs, (0, 0))
        self.seen = end
