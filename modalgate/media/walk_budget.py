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
# ...and a few more for each frame a walk counts (a GIF frame is an extension and a data
# chain; an APNG frame a control chunk and its data): the walk stops one frame past
# the caller's limit, so a still is judged alike under every policy.
ENTRIES_PER_FRAME = 8
# Progressive JPEG scans: libjpeg passes over the whole coefficient buffer for each, so
# decoding grows with scans times pixels (cure53's libjpeg-turbo audit; nvImageCodec
# refuses past this count by default).
MAX_JPEG_SCANS = 256
# A TIFF directory (a TIFF file's, or an Exif segment's) holds tens of tags; the format
# allows 65,535, each a step of Pillow's reader (~70 ms for them all).
MAX_TIFF_DIRECTORY_ENTRIES = 1024


def entry_budget(size: int, bytes_per_entry: int) -> int:
    """The entries a walk of a ``size``-byte container may read, before its frames."""
    return BASE_ENTRIES + size // bytes_per_entry


def over_budget(what: str, size: int) -> str:
    """The refusal's detail, in the words of the format's own errors."""
    return f"more {what} than any encoder writes in {size} bytes"
