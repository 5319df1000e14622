"""Opening image bytes with Pillow's format plugins directly.

``Image.open`` applies Pillow's process-wide ``MAX_IMAGE_PIXELS`` (a warning,
then an error at twice the value). That is not a policy: modalgate's own pixel
limit decides, so images are opened through the plugin class of the format the
magic bytes named, which reads the header and touches no pixel data.
"""

from __future__ import annotations

import contextlib
import io
import threading
import warnings
from collections.abc import Callable, Iterator

from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    IcoImagePlugin,
    ImageFile,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
)

PLUGINS: dict[str, Callable[[io.BytesIO], ImageFile.ImageFile]] = {
    "png": PngImagePlugin.PngImageFile,
    "jpeg": JpegImagePlugin.JpegImageFile,
    "gif": GifImagePlugin.GifImageFile,
    "bmp": BmpImagePlugin.BmpImageFile,
    "tiff": TiffImagePlugin.TiffImageFile,
    "ico": IcoImagePlugin.IcoImageFile,
}
try:
    from PIL import WebPImagePlugin

    PLUGINS["webp"] = WebPImagePlugin.WebPImageFile
except ImportError:  # pragma: no cover - Pillow built without libwebp
    pass
try:  # Pillow >= 11.2 built with libavif
    from PIL import AvifImagePlugin

    PLUGINS["avif"] = AvifImagePlugin.AvifImageFile
except ImportError:  # pragma: no cover
    pass

_PNG_IEND = b"IEND\xaeB`\x82"
_JPEG_EOI = b"\xff\xd9"


# catch_warnings swaps process-wide state; two threads interleaving it could leave
# warnings off for good, so header reads that silence Pillow take turns.
_QUIET = threading.Lock()


@contextlib.contextmanager
def quiet_pillow() -> Iterator[None]:
    """Silence Pillow's warnings about hostile headers ("Corrupt EXIF data") while reading one.

    Hold it only for header work (microseconds): it serialises its holders.
    """
    with _QUIET, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def open_image(data: bytes, fmt: str) -> ImageFile.ImageFile:
    """The image object (header read, pixels not); raises whatever the plugin raises."""
    plugin = PLUGINS.get(fmt)
    if plugin is None:
        raise KeyError(fmt)
    return plugin(io.BytesIO(data))


def is_truncated(data: bytes, fmt: str) -> bool:
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
