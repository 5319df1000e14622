"""How many entries a container walk reads before it calls the file hostile.

A walk's cost is per entry (a PNG chunk, a JPEG segment, a GIF sub-block, a RIFF
chunk), not per byte, and Pillow's header readers walk the same entries again in
Python. A body of empty entries therefore cost 10^2 to 10^4 times what a real
image of its size does: 1 MB of 4-byte JPEG comment segments took 0.7 s to
probe, 1 MB of empty PNG chunks 0.4 s, so one 64 MiB body could hold a
validation thread for most of a minute. Encoders write few, large entries (libpng's IDAT
chunks are 8 KiB, GIF encoders write 255-byte sub-blocks, a JPEG has tens of
segments), so a floor plus one entry per ``bytes_per_entry`` bytes is far above
any real file and keeps the walk near the cost of a real image. The floor is
per image and a request may carry hundreds, so it stays small: at the floor,
an image costs a few times the fixed cost of reading a real image's header.
"""

from __future__ import annotations

# Entries any file may hold, whatever its size: headers, metadata, a palette...
BASE_ENTRIES = 128
# ...and a few per frame the walk may count (a GIF frame is an extension and a data
# chain; an APNG frame a control chunk and its data), up to this many frames.
ENTRIES_PER_FRAME = 8
_FRAMES_COUNTED = 1 << 16
# Progressive JPEG scans: libjpeg passes over the whole coefficient buffer for each, so
# decoding grows with scans times pixels (cure53's libjpeg-turbo audit; nvImageCodec
# refuses past this count by default).
MAX_JPEG_SCANS = 256


def entry_budget(size: int, bytes_per_entry: int, frame_limit: int = 1) -> int:
    """The entries a walk of a ``size``-byte container may read."""
    frames = min(max(frame_limit, 1), _FRAMES_COUNTED)
    return BASE_ENTRIES + ENTRIES_PER_FRAME * frames + size // bytes_per_entry


def over_budget(what: str, size: int) -> str:
    """The refusal's detail, in the words of the format's own errors."""
    return f"more {what} than any encoder writes in {size} bytes"
