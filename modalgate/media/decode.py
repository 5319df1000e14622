"""Full image decoding for the encoder: RGB out, never on the event loop.

By the time bytes get here the validators have read the header and refused
anything over the pixel limit, so a decode never allocates more than the policy
allows; the ceiling is checked again here from the header (before any pixel is
touched) because decoding is also reachable without the gate. Truncated files
are refused: Pillow's ``LOAD_TRUNCATED_IMAGES`` would pad them with grey, and
an encoder would then describe pixels the user never sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image, ImageOps

from modalgate.media.image_integrity import ImageIntegrityError, check_structure
from modalgate.media.pillow import PLUGINS, open_image
from modalgate.media.sniff import sniff

try:  # libjpeg-turbo with warnings as errors: Pillow's JPEG decoder swallows them
    import simplejpeg
except ImportError:  # pragma: no cover - optional; Pillow decodes JPEG then
    simplejpeg = None

logger = logging.getLogger("modalgate.media")
Color = tuple[int, int, int]


class DecodeError(ValueError):
    """The image cannot be decoded; the text is safe to show a client."""


DEFAULT_MAX_PIXELS = (512 * 14) ** 2


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    max_pixels: int = DEFAULT_MAX_PIXELS
    background: Color = (255, 255, 255)  # alpha is composited onto this


def decode_image(data: bytes, options: DecodeOptions = DecodeOptions()) -> Image.Image:
    """Decode to an RGB image with EXIF orientation applied."""
    sniffed = sniff(data[:64])
    if sniffed is None or sniffed.format not in PLUGINS:
        raise DecodeError("the data is not a supported image")
    try:  # whatever LOAD_TRUNCATED_IMAGES says: only the first frame is decoded
        check_structure(data, sniffed.format, frame_limit=1, max_pixels=options.max_pixels)
    except ImageIntegrityError as exc:
        raise DecodeError(str(exc)) from None
    try:
        image = open_image(data, sniffed.format)
        width, height = image.size
        if width * height > options.max_pixels:
            raise DecodeError(
                f"image is {width}x{height}; the limit is {options.max_pixels} pixels"
            )
        image.load()
        image = ImageOps.exif_transpose(image)
    except DecodeError:
        raise
    except Exception as exc:
        # Pillow says "image file is truncated" and the like, with internals; keep it short.
        raise DecodeError(f"the {sniffed.format.upper()} image cannot be decoded") from exc
    return to_rgb(image, options.background)


def verify_image_data(
    data: bytes, fmt: str, frames: int = 1, max_pixels: int = DEFAULT_MAX_PIXELS
) -> None:
    """Decode every pixel of the first ``frames`` frames, or raise DecodeError.

    The structural checks (``media.image_integrity``) cannot see inside compressed
    data: a baseline JPEG cut mid-scan with ``FFD9`` appended or a GIF whose LZW data
    stops early look whole (a PNG's streams are inflated by the walk itself). Decoding
    finds them, at decoding's price. Call ``check_structure`` first, for the frame
    count; ``max_pixels`` bounds every frame decoded here.
    """
    name = fmt.upper()
    try:
        if fmt == "png":  # the walk inflates every frame's pixel data (media.png_pixels)
            check_structure(data, fmt, frames, max_pixels)
        elif fmt == "jpeg" and simplejpeg is not None:
            # Gray at 1/8 scale: the entropy-coded data is read in full, little is written.
            simplejpeg.decode_jpeg(data, colorspace="GRAY", min_factor=8, strict=True)
        else:
            image = open_image(data, fmt)
            for index in range(frames):
                if index:
                    image.seek(index)
                if image.size[0] * image.size[1] > max_pixels:  # a later TIFF page, say
                    raise DecodeError(f"a {name} frame is over the pixel limit")
                image.load()
    except DecodeError:
        raise
    except ImageIntegrityError as exc:
        raise DecodeError(str(exc)) from None
    except Exception as exc:
        # libjpeg, zlib and Pillow describe the damage with internals; keep it short.
        raise DecodeError(f"the {name} image data is corrupt or truncated") from exc


def to_rgb(image: Image.Image, background: Color = (255, 255, 255)) -> Image.Image:
    """Any Pillow mode to RGB; transparency is composited, 16-bit depth is scaled, not clipped."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit samples: keep the top 8 bits (convert("L") would clip at 255).
        image = image.convert("I").point(lambda value: value * (1 / 256)).convert("L")
        mode = "L"
    if mode == "F":
        image = image.point(lambda value: value * 255).convert("L")
        mode = "L"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        base = Image.new("RGB", rgba.size, background)
        base.paste(rgba, mask=rgba.getchannel("A"))
        return base
    return image.convert("RGB")


class DecodePool:
    """A bounded thread pool for decodes: CPU work off the loop, at most ``workers`` at once."""

    def __init__(self, workers: int = 2, options: DecodeOptions = DecodeOptions()) -> None:
        self.options = options
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="modalgate-decode"
        )

    async def decode(self, data: bytes) -> Image.Image:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, decode_image, data, self.options)

    async def decode_many(self, items: Sequence[bytes]) -> list[Image.Image | DecodeError]:
        """One result per item; one bad image never fails the others."""
        results = await asyncio.gather(*(self.decode(d) for d in items), return_exceptions=True)
        out: list[Image.Image | DecodeError] = []
        for result in results:
            if isinstance(result, DecodeError | Image.Image):
                out.append(result)
            elif isinstance(result, BaseException):
                logger.error("decoding failed unexpectedly", exc_info=result)
                out.append(DecodeError("the image cannot be decoded"))
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
