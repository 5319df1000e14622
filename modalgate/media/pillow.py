"""Opening image bytes with Pillow's format plugins directly.

``Image.open`` applies Pillow's process-wide ``MAX_IMAGE_PIXELS`` (a warning,
then an error at twice the value). That is not a policy: modalgate's own pixel
limit decides, so images are opened through the plugin class of the format the
magic bytes named, which reads the header and touches no pixel data.
"""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Callable

from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    IcoImagePlugin,
    ImageFile,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
)

from modalgate.media.image_integrity import ImageIntegrityError, check_structure

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

# Pillow's format plugins warn about hostile headers ("Corrupt EXIF data", "Metadata
# Warning", "Invalid APNG") and then carry on or raise; the gate refuses such images
# with its own message. Silenced by filters on those modules only, not by a
# ``warnings.catch_warnings()`` around each read: that swaps process-wide state (not
# thread-safe), and the lock that made it safe made small requests on the event
# loop wait behind a big image's header read in a worker thread.
_QUIET_FILTERS = (  # (module, message) patterns; category UserWarning
    (r"PIL\.\w+ImagePlugin", ""),
    (r"PIL\.Image", "Possibly corrupt EXIF"),
)
_quiet_list: list[object] | None = None


def _quiet_plugins() -> None:
    """Install the filters unless present; one identity check per call once done.

    A ``catch_warnings()`` block restores the list it saved on exit, so filters
    installed inside one (an import under pytest) vanish; they are put back here.
    A filter the application put in front of them still wins.
    """
    global _quiet_list
    if warnings.filters is _quiet_list:
        return
    present = {
        (f[3].pattern, f[1].pattern if f[1] else "")
        for f in warnings.filters
        if f[0] == "ignore" and f[2] is UserWarning and f[3] is not None
    }
    for module, message in _QUIET_FILTERS:
        if (module, message) not in present:
            warnings.filterwarnings("ignore", message, UserWarning, module)
    _quiet_list = warnings.filters


_quiet_plugins()


def open_image(data: bytes, fmt: str) -> ImageFile.ImageFile:
    """The image object (header read, pixels not); raises whatever the plugin raises."""
    plugin = PLUGINS.get(fmt)
    if plugin is None:
        raise KeyError(fmt)
    _quiet_plugins()
    return plugin(io.BytesIO(data))


def is_truncated(data: bytes, fmt: str) -> bool:
    """Whether the container structure is cut short or broken (``media.image_integrity``)."""
    try:
        check_structure(data, fmt, frame_limit=sys.maxsize)
    except ImageIntegrityError:
        return True
    return False
