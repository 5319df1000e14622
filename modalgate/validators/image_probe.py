"""Image facts from the header alone: format, size, frames, and whether the file is whole.

Pillow's format plugins read headers without touching pixel data. They are
called directly rather than through ``Image.open`` so that Pillow's global
``MAX_IMAGE_PIXELS`` never decides anything: the policy's pixel limit does, and
a header declaring 100000x100000 costs a few microseconds to refuse.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    IcoImagePlugin,
    Image,
    ImageFile,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
)

_PLUGINS: dict[str, Callable[[io.BytesIO], ImageFile.ImageFile]] = {
    "png": PngImagePlugin.PngImageFile,
    "jpeg": JpegImagePlugin.JpegImageFile,
    "gif": GifImagePlugin.GifImageFile,
    "bmp": BmpImagePlugin.BmpImageFile,
    "tiff": TiffImagePlugin.TiffImageFile,
    "ico": IcoImagePlugin.IcoImageFile,
}
try:
    from PIL import WebPImagePlugin

    _PLUGINS["webp"] = WebPImagePlugin.WebPImageFile
except ImportError:  # pragma: no cover - Pillow built without libwebp
    pass

_PNG_IEND = b"IEND\xaeB`\x82"
_JPEG_EOI = b"\xff\xd9"


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
    plugin = _PLUGINS.get(fmt)
    if plugin is None:
        raise ImageProbeError(f"{fmt} images cannot be inspected here")
    if _is_truncated(data, fmt):
        raise ImageProbeError(f"the {fmt.upper()} data is truncated")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = plugin(io.BytesIO(data))
            width, height = image.size
            frames = int(getattr(image, "n_frames", 1) or 1)
    except Image.DecompressionBombError as exc:  # pragma: no cover - not reached via plugins
        raise ImageProbeError("the image declares too many pixels") from exc
    except Exception as exc:
        # Header parsers meet hostile bytes here; any failure is the client's bad image.
        raise ImageProbeError(f"the {fmt.upper()} header cannot be read") from exc
    if width <= 0 or height <= 0:
        raise ImageProbeError(f"the {fmt.upper()} header declares an empty image")
    return ImageFacts(fmt, width, height, frames)


def _is_truncated(data: bytes, fmt: str) -> bool:
    """Structural end-of-file checks: cheap, and they catch files cut in transfer."""
    if fmt == "png":
        return not data.rstrip(b"\x00").endswith(_PNG_IEND)
    if fmt == "jpeg":
        return data.rfind(_JPEG_EOI, max(0, len(data) - 1024)) < 0
    if fmt == "gif":
        return b";" not in data[-16:]
    if fmt == "webp":
        return len(data) < 12 or int.from_bytes(data[4:8], "little") + 8 > len(data)
    return False
