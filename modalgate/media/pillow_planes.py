"""Reading a Pillow image's pixels where Pillow keeps them, without a copy.

Pillow (11.2 and later) exports images through the Arrow PyCapsule interface
(``__arrow_c_array__``); the data buffer of that export is the image's own
pixel block: one byte per pixel for "L" and "P", four for the three- and
four-band 8-bit modes ("RGB": R, G, B, padding; "RGBA": R, G, B, A). numpy
reads it in place through ``__array_interface__``.

The export is a capsule holding a ``struct ArrowArray`` (the Arrow C data
interface, a stable ABI); its address comes from CPython's
``PyCapsule_GetPointer``, called through a ctypes prototype of our own. The
usual idiom, setting ``argtypes`` and ``restype`` on
``ctypes.pythonapi.PyCapsule_GetPointer``, changes that shared object for
every other user in the process; the prototype here changes nothing.

Where the export is missing (older Pillow, no ``pythonapi``) or is not one
plain block (images over Pillow's 16 MB block size are stored in pieces), the
pixels are copied out instead: same values, a copy.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import numpy as np
from PIL import Image

__all__ = ["PillowMemory", "pixels", "planes"]

# Modes whose pixels Pillow stores as their bands in order in four bytes (the
# three-band ones with one padding byte last), and the one-byte modes. Not "LAB":
# Pillow stores its a and b offset by 128 from what ``np.asarray`` shows.
_FOUR_BYTE_MODES = frozenset({"RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "HSV"})
_ONE_BYTE_MODES = frozenset({"L", "P"})
# Modes whose bands, split, are the bytes ``np.asarray`` shows.
_SPLIT_MODES = _FOUR_BYTE_MODES | _ONE_BYTE_MODES | {"LA", "La", "PA"}


class _ArrowArray(ctypes.Structure):
    """``struct ArrowArray`` of the Arrow C data interface (a stable, documented ABI)."""


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]

# void *PyCapsule_GetPointer(PyObject *capsule, const char *name), called with the
# GIL held and Python's error indicator checked (a wrong name raises ValueError).
_CapsuleGetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)


def _capsule_getter() -> Callable[[object, bytes], int] | None:
    """CPython's ``PyCapsule_GetPointer`` through a private, typed prototype; None
    where there is no ``pythonapi``. The symbol is looked up in ``pythonapi``'s
    library handle: ``ctypes.pythonapi`` itself is neither given nor changed an
    attribute."""
    try:
        return _CapsuleGetPointer(("PyCapsule_GetPointer", ctypes.pythonapi))
    except (AttributeError, OSError):
        return None


_capsule_pointer = _capsule_getter()


class PillowMemory:
    """A Pillow image's own pixel memory, for ``np.asarray``, without a copy.

    ``shape`` is what the block holds: ``(h, w)`` for one byte per pixel,
    ``(h, w, 4)`` for four. The object keeps the image and the export alive for
    as long as an array made from it exists; arrays are read-only. Raises
    TypeError or ValueError (AttributeError on Pillow without the export) where
    the image cannot be read in place: callers copy instead.
    """

    def __init__(self, image: Image.Image, shape: tuple[int, ...]) -> None:
        if _capsule_pointer is None:
            raise TypeError("no PyCapsule API in this interpreter")
        _, capsule = image.__arrow_c_array__()
        array = _ArrowArray.from_address(_capsule_pointer(capsule, b"arrow_array"))
        if array.n_children == 1:  # multi-band pixels: a fixed-size list of bytes
            array = array.children[0].contents
        if array.offset != 0 or array.n_buffers != 2 or array.length != math.prod(shape):
            raise ValueError("unexpected Arrow layout")
        self._owners = (image, capsule)
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": "|u1",
            "data": (array.buffers[1], True),  # read-only
        }


def planes(image: Image.Image) -> list[np.ndarray]:
    """The image's bands as ``[H, W]`` uint8 arrays, read-only.

    ``split()`` separates the bands in one C pass; each is then read in place
    (``PillowMemory``), or, where that is not possible, copied out. Stacked on
    the last axis they equal ``np.asarray(image)`` (for one band, the one plane).
    Raises ValueError for modes where they would not: bands wider or narrower
    than a byte ("1", "I", "F", "I;16"), and "LAB".
    """
    if image.mode not in _SPLIT_MODES:
        raise ValueError(f"no 8-bit planes as np.asarray reads them: {image.mode}")
    shape = (image.height, image.width)
    out = []
    for band in image.split():
        try:
            out.append(np.asarray(PillowMemory(band, shape)))
        except (AttributeError, TypeError, ValueError):
            out.append(np.frombuffer(band.tobytes(), np.uint8).reshape(shape))
    return out


def pixels(image: Image.Image) -> np.ndarray:
    """The image's pixels as uint8, read-only, in place where Pillow allows it.

    ``[H, W, 4]`` for the modes Pillow stores in four bytes (for a three-band
    mode such as "RGB" the fourth channel is Pillow's padding byte), ``[H, W]``
    for "L" and "P"; a copy, ``np.asarray(image)``, otherwise (other modes, or no
    export). Either way ``[..., :bands]`` equals ``np.asarray(image)``.
    """
    shape: tuple[int, ...] | None = None
    if image.mode in _FOUR_BYTE_MODES:
        shape = (image.height, image.width, 4)
    elif image.mode in _ONE_BYTE_MODES:
        shape = (image.height, image.width)
    if shape is not None:
        try:
            return np.asarray(PillowMemory(image, shape))
        except (AttributeError, TypeError, ValueError):
            pass
    return np.asarray(image)
