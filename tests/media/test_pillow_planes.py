"""modalgate.media.pillow_planes: Pillow's pixels read in place, equal to ``np.asarray``."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from modalgate.media import pillow_planes
from modalgate.media.pillow_planes import PillowMemory, pixels, planes

SPLIT_MODES = ["L", "P", "LA", "PA", "La", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "HSV"]
IN_PLACE_MODES = ["L", "P", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "HSV"]
SIZES = [(1, 1), (37, 23), (640, 480)]


def noise(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    """Seeded random bytes in ``mode`` (its raw layout: one byte per band)."""
    bands = len(Image.new(mode, (1, 1)).getbands())
    data = np.random.default_rng(seed).integers(0, 256, width * height * bands, dtype=np.uint8)
    return Image.frombytes(mode, (width, height), data.tobytes())


def stacked(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.stack(arrays, axis=-1)


def in_place(array: np.ndarray) -> bool:
    return isinstance(array.base, PillowMemory)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_planes_equal_asarray(mode: str, size: tuple[int, int]) -> None:
    image = noise(mode, *size, seed=len(mode))
    result = planes(image)
    assert len(result) == len(image.getbands())
    for plane in result:
        assert plane.dtype == np.uint8 and plane.shape == (size[1], size[0])
        assert in_place(plane) and not plane.flags.writeable
    np.testing.assert_array_equal(stacked(result), np.asarray(image))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", IN_PLACE_MODES)
def test_pixels_in_place_equal_asarray(mode: str, size: tuple[int, int]) -> None:
    image = noise(mode, *size, seed=3)
    result = pixels(image)
    expected = np.asarray(image)
    assert in_place(result) and not result.flags.writeable
    if expected.ndim == 2:
        np.testing.assert_array_equal(result, expected)
    else:
        assert result.shape == (size[1], size[0], 4)  # three bands: the fourth is padding
        np.testing.assert_array_equal(result[..., : expected.shape[-1]], expected)


@pytest.mark.parametrize("mode", ["1", "LA", "PA", "La", "LAB", "I", "F", "I;16"])
def test_pixels_of_other_modes_are_asarray(mode: str) -> None:
    if mode in ("1", "I", "F", "I;16"):
        image = noise("L", 31, 17, seed=5).convert(mode)
    else:
        image = noise(mode, 31, 17, seed=5)
    result = pixels(image)
    assert not in_place(result)
    np.testing.assert_array_equal(result, np.asarray(image))
    assert result.dtype == np.asarray(image).dtype


@pytest.mark.parametrize("mode", ["1", "I", "F", "I;16", "LAB"])
def test_planes_refuses_modes_not_read_as_bytes(mode: str) -> None:
    """Bands wider or narrower than a byte; LAB, whose a and b Pillow stores offset."""
    image = noise("LAB", 8, 8) if mode == "LAB" else noise("L", 8, 8).convert(mode)
    with pytest.raises(ValueError, match="8-bit planes"):
        planes(image)


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_without_the_capsule_api_pixels_are_copied(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    image = noise(mode, 101, 67, seed=7)
    expected = np.asarray(image)
    monkeypatch.setattr(pillow_planes, "_capsule_pointer", None)
    split = planes(image)
    assert not any(in_place(plane) for plane in split)
    np.testing.assert_array_equal(stacked(split), expected)
    whole = pixels(image)
    assert not in_place(whole)
    np.testing.assert_array_equal(whole, expected)


def test_without_the_arrow_export_pixels_are_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow before 11.2 has no ``__arrow_c_array__``."""
    image = noise("RGB", 64, 48, seed=8)
    expected = np.asarray(image)

    def missing(self: Image.Image, *args: object) -> object:
        raise AttributeError("__arrow_c_array__")

    monkeypatch.setattr(Image.Image, "__arrow_c_array__", missing)
    assert not in_place(pixels(image))
    np.testing.assert_array_equal(pixels(image), expected)
    np.testing.assert_array_equal(stacked(planes(image)), expected)


def test_image_in_several_blocks_is_copied() -> None:
    """Over Pillow's 16 MB block size the pixels are stored in pieces: not one buffer."""
    height, width = 3000, 6000  # 72 MB as RGB(X), 18 MB per plane
    x, y = np.arange(width), np.arange(height)
    rgb = np.empty((height, width, 3), np.uint8)
    rgb[..., 0] = (x % 251).astype(np.uint8)
    rgb[..., 1] = (y % 241).astype(np.uint8)[:, None]
    np.add(x.astype(np.uint8), (3 * y).astype(np.uint8)[:, None], out=rgb[..., 2])  # mod 256
    image = Image.fromarray(rgb)
    with pytest.raises(ValueError):
        PillowMemory(image, (height, width, 4))
    whole = pixels(image)
    assert not in_place(whole)
    assert np.array_equal(whole, rgb)
    split = planes(image)
    assert not any(in_place(plane) for plane in split)
    assert all(np.array_equal(plane, rgb[..., band]) for band, plane in enumerate(split))


def test_arrays_keep_the_image_alive() -> None:
    def read() -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        image = noise("RGB", 300, 200, seed=9)
        return planes(image), pixels(image), np.array(image)

    split, whole, expected = read()
    gc.collect()
    Image.new("RGB", (300, 200), (1, 2, 3)).load()  # reuse freed memory, were it freed
    np.testing.assert_array_equal(stacked(split), expected)
    np.testing.assert_array_equal(whole[..., :3], expected)


def test_wrong_capsule_name_raises_as_python_api() -> None:
    """The private prototype keeps ``pythonapi``'s semantics: CPython's error is raised."""
    assert pillow_planes._capsule_pointer is not None
    _, capsule = Image.new("L", (2, 2)).__arrow_c_array__()
    with pytest.raises(ValueError):
        pillow_planes._capsule_pointer(capsule, b"not_arrow_array")


def test_pythonapi_is_left_alone_in_process() -> None:
    before = dict(vars(ctypes.pythonapi))
    planes(noise("RGB", 20, 10))
    pixels(noise("RGB", 20, 10))
    assert dict(vars(ctypes.pythonapi)) == before
    if "PyCapsule_GetPointer" in before:  # someone else's: as they left it
        function = before["PyCapsule_GetPointer"]
        assert ctypes.pythonapi.PyCapsule_GetPointer is function


def test_pythonapi_is_left_alone_in_a_fresh_interpreter() -> None:
    """Importing and using the reader neither adds nor retypes
    ``ctypes.pythonapi.PyCapsule_GetPointer``."""
    script = """
import ctypes
import numpy as np
from PIL import Image
from modalgate.media.pillow_planes import PillowMemory, pixels, planes
image = Image.new("RGB", (20, 10), (1, 2, 3))
assert isinstance(pixels(image).base, PillowMemory)
assert isinstance(planes(image)[0].base, PillowMemory)
assert "PyCapsule_GetPointer" not in vars(ctypes.pythonapi)
function = ctypes.pythonapi.PyCapsule_GetPointer
assert function.argtypes is None, function.argtypes
assert function.restype is ctypes.c_int, function.restype
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
