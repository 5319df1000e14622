"""Image facts without decoding: format, size, frames, and whether the file is whole.

The container is walked first (``media.image_integrity``: chunk CRCs, JPEG scans,
GIF block chains; frames counted only up to the caller's limit), then the header
is read by Pillow's format plugin (``media.pillow``), so the policy's pixel limit
decides, not Pillow's global one: a header declaring 100000x100000 costs
microseconds to refuse. Nothing here takes a lock or touches process-wide state,
so a big image probed in a worker thread never delays a small one on the event
loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from modalgate.media.image_integrity import ImageIntegrityError, check_structure
from modalgate.media.pillow import PLUGINS, open_image

# Frames counted when the caller names no limit: finite, like every other count here.
DEFAULT_FRAME_LIMIT = 1000


class ImageProbeError(ValueError):
    """The header cannot be read, or the file is cut short."""


@dataclass(frozen=True, slots=True)
class ImageFacts:
    format: str
    width: int
    height: int
    frames: int  # counted up to frame_limit + 1
    frames_capped: bool = False  # counting stopped early: ``frames`` is a lower bound


def probe_image(
    data: bytes,
    fmt: str,
    frame_limit: int = DEFAULT_FRAME_LIMIT,
    max_pixels: int | None = None,
) -> ImageFacts:
    """Walk and read the header of ``data``, whose magic bytes said ``fmt``.

    Frames are counted up to ``frame_limit + 1`` and no further: one past the limit
    is enough to refuse, and Pillow's own count decodes every frame of a GIF. An
    image over ``max_pixels`` is refused for its size by the caller, so the checks
    that compare its data with its declared size are skipped for it.
    """
    if fmt not in PLUGINS:
        raise ImageProbeError(f"{fmt} images cannot be inspected here")
    try:
        structure = check_structure(data, fmt, frame_limit, max_pixels)
    except ImageIntegrityError as exc:
        raise ImageProbeError(str(exc)) from None
    try:
        image = open_image(data, fmt)
        width, height = image.size
        # Formats without a walker (AVIF, ICO) carry their count in the header.
        frames = structure.frames if structure else int(getattr(image, "n_frames", 1) or 1)
    except Exception as exc:
        # Header parsers meet hostile bytes here; any failure is the client's bad image.
        raise ImageProbeError(f"the {fmt.upper()} header cannot be read") from exc
    if width <= 0 or height <= 0:
        raise ImageProbeError(f"the {fmt.upper()} header declares an empty image")
    return ImageFacts(fmt, width, height, frames, bool(structure and structure.capped))
