"""Image facts from the header alone: format, size, frames, and whether the file is whole.

The header is read by Pillow's format plugin (``media.pillow``), so the
policy's pixel limit decides, not Pillow's global one, and a header declaring
100000x100000 costs a few microseconds to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from modalgate.media.pillow import PLUGINS, is_truncated, open_image, quiet_pillow


class ImageProbeError(ValueError):
    """The header cannot be read, or the file is cut short."""


@dataclass(frozen=True, slots=True)
class ImageFacts:
    format: str
    width: int
    height: int
    frames: int


def probe_image(data: bytes, fmt: str) -> ImageFacts:
    """Read the header of ``data``, whose magic bytes said ``fmt``."""
    if fmt not in PLUGINS:
        raise ImageProbeError(f"{fmt} images cannot be inspected here")
    if is_truncated(data, fmt):
        raise ImageProbeError(f"the {fmt.upper()} data is truncated")
    try:
        with quiet_pillow():
            image = open_image(data, fmt)
            width, height = image.size
            frames = int(getattr(image, "n_frames", 1) or 1)
    except Exception as exc:
        # Header parsers meet hostile bytes here; any failure is the client's bad image.
        raise ImageProbeError(f"the {fmt.upper()} header cannot be read") from exc
    if width <= 0 or height <= 0:
        raise ImageProbeError(f"the {fmt.upper()} header declares an empty image")
    return ImageFacts(fmt, width, height, frames)
