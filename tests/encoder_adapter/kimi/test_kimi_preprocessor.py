"""KimiPreprocessor against transformers' Kimi_K25ImageProcessor, the reference it replaces.

The reference is built the way users build it (``Kimi_K25ImageProcessor(...)``
with the settings as keyword arguments, ``size={"max_height", "max_width"}`` for
the per-side limit) and called on the same PIL images with
``return_tensors="pt"``. transformers and torchvision are test dependencies on
purpose: these tests must fail, not skip, where the reference is missing. Only
the CUDA test skips, on machines without a GPU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.kimi_k25.image_processing_kimi_k25 import (
    Kimi_K25ImageProcessor,
    navit_resize,
)

from modalgate.encoder_adapter.kimi import preprocess
from modalgate.encoder_adapter.kimi.preprocess import KimiPreprocessor, navit_size
from modalgate.media import pillow_planes

TOLERANCE = 1e-6  # max abs difference allowed on pixel_values (in practice: 0)

# name -> (patch_size, merge_size, max_patches, max_side)
SETTINGS = {
    "k3": (14, 2, 65536, 512),
    "k25": (14, 2, 16384, 512),  # Kimi_K25ImageProcessor's defaults
    "small": (14, 2, 256, 24),  # tight limits: cheap images hit both of them
}

# (width, height): tiny, thin, exact multiples of 28, odd sizes, common photo shapes,
# over max_side (7168 px per side at patch 14) and over max_patches for K2.5.
SIZES = [
    (1, 1),
    (2, 3),
    (5, 300),
    (300, 5),
    (13, 13),
    (14, 14),
    (15, 29),
    (27, 28),
    (28, 28),
    (56, 84),
    (448, 448),
    (100, 37),
    (333, 777),
    (640, 480),
    (480, 640),
    (1000, 1000),
    (1023, 511),
    (1280, 720),
    (1920, 1080),
    (7200, 30),  # wider than 512 patches: the per-side limit scales it down
    (30, 8000),
    (2100, 1700),  # 18150 patches: K2.5 scales it down, K3 does not
]


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Seeded random pixels: the hardest content for a resize to reproduce exactly."""
    bands = len(mode) if mode in ("RGB", "RGBA", "LA") else 1
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode)


def reference(name: str, **extra: object) -> Kimi_K25ImageProcessor:
    patch, merge, max_patches, max_side = SETTINGS[name]
    return Kimi_K25ImageProcessor(
        patch_size=patch,
        merge_size=merge,
        max_patches=max_patches,
        size={"max_height": max_side, "max_width": max_side},
        **extra,
    )


def ours(name: str, **extra: object) -> KimiPreprocessor:
    patch, merge, max_patches, max_side = SETTINGS[name]
    return KimiPreprocessor(
        patch_size=patch, merge_size=merge, max_patches=max_patches, max_side=max_side, **extra
    )


def assert_conforms(
    ref: Kimi_K25ImageProcessor, mine: KimiPreprocessor, images: Sequence[Image.Image]
) -> float:
    """Same grid (exactly), same pixel_values (within TOLERANCE); returns the max difference."""
    expected = ref(list(images), return_tensors="pt")
    pixels, grid = mine(list(images))
    assert torch.equal(grid, expected["image_grid_thw"])
    assert pixels.shape == expected["pixel_values"].shape
    assert pixels.dtype == expected["pixel_values"].dtype == torch.float32
    diff = (pixels - expected["pixel_values"]).abs().max().item() if pixels.numel() else 0.0
    assert diff <= TOLERANCE, diff
    return diff


# ---------------------------------------------------------------- conformance


def test_reference_output_names() -> None:
    """The reference returns pixel_values and image_grid_thw; ours are (pixel_values, grid)."""
    expected = reference("k3")([noise_image(40, 30)], return_tensors="pt")
    assert set(expected.keys()) == {"pixel_values", "image_grid_thw"}
    assert expected["image_grid_thw"].dtype == torch.long


def test_defaults_are_the_references() -> None:
    ref, mine = Kimi_K25ImageProcessor(), KimiPreprocessor()
    assert (mine.patch_size, mine.merge_size) == (ref.patch_size, ref.merge_size)
    assert mine.max_patches == ref.max_patches
    assert mine.max_side == ref.size["max_height"] == ref.size["max_width"]
    assert list(mine.image_mean) == list(ref.image_mean)
    assert list(mine.image_std) == list(ref.image_std)
    assert ref.rescale_factor == 1 / 255


@pytest.mark.parametrize("name", ["k3", "k25", "small"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_conforms_one_image(name: str, size: tuple[int, int]) -> None:
    width, height = size
    image = noise_image(width, height, seed=width * 31 + height)
    assert_conforms(reference(name), ours(name), [image])


@pytest.mark.parametrize("name", ["k3", "k25"])
def test_conforms_when_max_patches_scales_down(name: str) -> None:
    """4200x3200 has 68400 whole patches: both settings downscale it (K3 barely)."""
    image = noise_image(4200, 3200, seed=7)
    ref, mine = reference(name), ours(name)
    (resized, _) = mine.sizes_for(4200, 3200)
    assert resized != (3200, 4200)
    assert_conforms(ref, mine, [image])


def test_grid_can_exceed_max_patches_as_the_reference_does() -> None:
    """The budget counts whole patches before padding; the padded grid can go past it."""
    mine = ours("k25")
    _, grid_h, grid_w = mine.grid_for(4000, 3000)
    assert grid_h * grid_w > mine.max_patches
    assert_conforms(reference("k25"), mine, [noise_image(4000, 3000, seed=3)])


def test_batch_of_mixed_sizes() -> None:
    """One call, mixed sizes (some repeated: the reference groups those), resized or not."""
    sizes = [(640, 480), (1, 1), (640, 480), (7200, 30), (333, 777), (28, 28), (333, 777)]
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    for name in ("k3", "k25", "small"):
        mine = ours(name)
        assert_conforms(reference(name), mine, images)
        pixels, grid = mine(images)
        assert grid.shape == (len(images), 3)
        assert int((grid[:, 1] * grid[:, 2]).sum()) == pixels.shape[0]
        # image i's patches are its own call's patches, in order
        start = 0
        for image, row in zip(images, grid.tolist(), strict=True):
            alone, alone_grid = mine([image])
            assert alone_grid.tolist() == [row]
            count = row[1] * row[2]
            assert torch.equal(pixels[start : start + count], alone)
            start += count


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA", "P", "CMYK", "I;16"])
def test_other_modes_convert_as_the_reference_does(mode: str) -> None:
    rgb = noise_image(61, 45, seed=5)
    if mode == "RGBA":
        image = noise_image(61, 45, seed=5, mode="RGBA")  # alpha composited onto white
    elif mode == "LA":
        image = noise_image(61, 45, seed=5, mode="LA")
    elif mode == "P":
        image = rgb.convert("P")
    elif mode == "I;16":
        image = Image.fromarray(np.random.default_rng(5).integers(0, 65536, (45, 61), np.uint16))
    else:
        image = rgb.convert(mode)
    assert_conforms(reference("k3"), ours("k3"), [image])


def test_rgb_with_transparency_key() -> None:
    """An RGB PNG with a tRNS chunk has ``info["transparency"]``: composited onto white."""
    image = noise_image(50, 40, seed=9)
    image.info["transparency"] = tuple(int(v) for v in np.asarray(image)[0, 0])
    assert_conforms(reference("k3"), ours("k3"), [image])


def test_resize_uses_the_references_kernel_on_flat_content() -> None:
    """Smooth content too (noise is the hard case, gradients the common one)."""
    y, x = np.mgrid[0:3100, 0:4100]
    pixels = np.stack([x % 256, y % 256, (x + y) % 256], axis=-1).astype(np.uint8)
    assert_conforms(reference("k25"), ours("k25"), [Image.fromarray(pixels)])


@pytest.mark.parametrize("size", [(640, 480), (1000, 999), (7200, 30)])
@pytest.mark.parametrize("missing", ["export", "capsule API"])
def test_without_zero_copy_pixels(
    monkeypatch: pytest.MonkeyPatch, size: tuple[int, int], missing: str
) -> None:
    """Where Pillow cannot export its memory (old Pillow, images in several blocks, no
    PyCapsule API), the pixels are copied out instead; the result is the same."""

    def unavailable(self: object, image: Image.Image, shape: tuple[int, ...]) -> None:
        raise ValueError("no Arrow export here")

    image = noise_image(*size, seed=11)
    expected = ours("k3")([image])
    if missing == "export":
        monkeypatch.setattr(pillow_planes.PillowMemory, "__init__", unavailable)
    else:
        monkeypatch.setattr(pillow_planes, "_capsule_pointer", None)
    pixels, grid = ours("k3")([image])
    assert torch.equal(grid, expected[1])
    assert torch.equal(pixels, expected[0])
    assert_conforms(reference("small"), ours("small"), [image])


def test_large_image_beyond_pillows_block_size() -> None:
    """6000x3000 RGB is stored in several of Pillow's blocks, so its pixels are copied out."""
    image = noise_image(6000, 3000, seed=2)
    with pytest.raises(ValueError):
        pillow_planes.PillowMemory(image, (3000, 6000, 4))
    assert_conforms(reference("k3"), ours("k3"), [image])


def test_custom_mean_and_std_per_channel() -> None:
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    images = [noise_image(300, 200, seed=1), noise_image(4100, 300, seed=2)]
    ref = reference("k3", image_mean=list(mean), image_std=list(std))
    assert_conforms(ref, ours("k3", image_mean=mean, image_std=std), images)


def test_every_pixel_value_in_every_channel() -> None:
    """All 256 values in all three channels (and padding), including through a resize."""
    values = np.arange(256, dtype=np.uint8)
    rows = np.stack([values, values[::-1], (values.astype(int) * 7 % 256).astype(np.uint8)], -1)
    image = Image.fromarray(np.tile(rows, (30, 1, 1)))  # 256x30, each column another value
    wide = Image.fromarray(np.tile(rows, (300, 10, 1)))  # 2560x300: "small" scales it down
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    for name in ("k3", "small"):
        assert_conforms(reference(name), ours(name), [image, wide])
        per_channel = reference(name, image_mean=list(mean), image_std=list(std))
        assert_conforms(per_channel, ours(name, image_mean=mean, image_std=std), [image, wide])


@pytest.mark.parametrize("band_patches", [1, 7, 64, 512])
def test_patch_order_against_plain_numpy(
    monkeypatch: pytest.MonkeyPatch, band_patches: int
) -> None:
    """The banded uint8 patchify equals pad-then-reshape, for any band size and shape."""
    monkeypatch.setattr(preprocess, "_BAND_PATCHES", band_patches)
    rng = np.random.default_rng(band_patches)
    for height, width in [(1, 1), (14, 14), (13, 29), (29, 13), (56, 56), (83, 97), (140, 3)]:
        planes = [rng.integers(0, 256, (height, width), dtype=np.uint8) for _ in range(3)]
        for p, factor in ((14, 28), (4, 4), (16, 32)):
            padded = (-(-height // factor) * factor, -(-width // factor) * factor)
            canvas = np.zeros((3, *padded), dtype=np.uint8)
            canvas[:, :height, :width] = planes
            grid_h, grid_w = padded[0] // p, padded[1] // p
            expected = canvas.reshape(3, grid_h, p, grid_w, p).transpose(1, 3, 0, 2, 4)
            got = np.concatenate([band.copy() for _, band in preprocess._bands(planes, padded, p)])
            assert np.array_equal(got, expected.reshape(-1, 3, p * p)), (height, width, p)
            starts = [first for first, _ in preprocess._bands(planes, padded, p)]
            assert starts[0] == 0 and starts == sorted(set(starts))


# ---------------------------------------------------------------- sizes, tokens, shapes


def test_navit_size_matches_the_reference() -> None:
    rng = random.Random(0)
    sizes = [(w, h) for w in range(1, 60) for h in range(1, 60)]
    sizes += [(rng.randint(1, 20000), rng.randint(1, 20000)) for _ in range(3000)]
    for patch, merge, max_patches, max_side in SETTINGS.values():
        for width, height in sizes:
            expected = navit_resize(height, width, patch, merge, max_patches, max_side)
            assert navit_size(height, width, patch, merge, max_patches, max_side) == expected


@pytest.mark.parametrize("name", ["k3", "k25", "small"])
def test_tokens_for_equals_the_grid(name: str) -> None:
    """tokens_for == h * w / merge**2 of the grid the images get, and the reference's count."""
    mine = ours(name)
    ref = reference(name)
    merge = mine.merge_size
    rng = random.Random(1)
    sizes = [*SIZES, *((rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(500))]
    for width, height in sizes:
        _, grid_h, grid_w = mine.grid_for(width, height)
        assert grid_h % merge == 0 and grid_w % merge == 0
        assert mine.tokens_for(width, height) == grid_h * grid_w // merge**2
        assert mine.tokens_for(width, height) * merge**2 == ref.get_number_of_image_patches(
            height, width
        )
    for width, height in [(1, 1), (640, 480), (7200, 30), (333, 777)]:
        _, grid = mine([noise_image(width, height)])
        assert grid.tolist() == [[1, *mine.grid_for(width, height)[1:]]]
        assert int(grid[0, 1] * grid[0, 2]) // merge**2 == mine.tokens_for(width, height)


def test_shapes_and_dtypes() -> None:
    mine = ours("k3")
    pixels, grid = mine([noise_image(100, 37), noise_image(28, 28)])
    assert pixels.dtype == torch.float32
    assert grid.dtype == torch.long
    assert pixels.shape == (4 * 8 + 2 * 2, 3, 14, 14)  # 100x37 pads to 112x56, 28x28 stays
    assert pixels.is_contiguous() and grid.is_contiguous()
    assert grid.tolist() == [[1, 4, 8], [1, 2, 2]]
    assert pixels.device.type == "cpu" and grid.device.type == "cpu"
    # padding is uint8 zero run through the normalisation: -mean/std, here -1
    one_pixel, _ = mine([Image.new("RGB", (1, 1), (255, 255, 255))])
    assert one_pixel.shape == (4, 3, 14, 14)
    assert one_pixel[0, :, 0, 0].tolist() == [1.0, 1.0, 1.0]
    assert (one_pixel[0, :, 0, 1:] == -1).all() and (one_pixel[1:] == -1).all()


def test_empty_batch() -> None:
    pixels, grid = ours("k3")([])
    assert pixels.shape == (0, 3, 14, 14) and pixels.dtype == torch.float32
    assert grid.shape == (0, 3) and grid.dtype == torch.long


def test_settings_key() -> None:
    key = ours("k3").settings_key()
    assert key == ours("k3").settings_key()
    assert key == KimiPreprocessor(max_patches=65536).settings_key()
    assert isinstance(key, str) and len(key) < 100 and key.isprintable()
    others = {
        KimiPreprocessor().settings_key(),
        KimiPreprocessor(max_patches=65536, patch_size=16).settings_key(),
        KimiPreprocessor(max_patches=65536, merge_size=1).settings_key(),
        KimiPreprocessor(max_patches=65536, max_side=256).settings_key(),
        KimiPreprocessor(max_patches=65536, image_mean=(0.5, 0.5, 0.4)).settings_key(),
        KimiPreprocessor(max_patches=65536, image_std=(0.5, 0.5, 0.4)).settings_key(),
    }
    assert key not in others and len(others) == 6


def test_refuses_bad_input() -> None:
    mine = ours("k3")
    with pytest.raises(TypeError):
        mine(noise_image(10, 10))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        mine([np.zeros((10, 10, 3), np.uint8)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        mine([Image.new("RGB", (0, 5))])
    for bad in ({"patch_size": 0}, {"merge_size": -1}, {"max_patches": 1.5}, {"max_side": True}):
        with pytest.raises(ValueError):
            KimiPreprocessor(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KimiPreprocessor(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError):
        KimiPreprocessor(image_mean=(0.5, 0.5))


# ---------------------------------------------------------------- the device path


DEVICE_SIZES = [(1, 1), (5, 300), (28, 28), (333, 777), (640, 480), (7200, 30), (2100, 1700)]


def device_path_on_cpu(name: str) -> KimiPreprocessor:
    """The torch-only path that CUDA runs, run on CPU tensors (it is device-agnostic)."""
    mine = ours(name)
    mine._fill_cpu = mine._fill_device  # type: ignore[method-assign]
    return mine


@pytest.mark.parametrize("name", ["k3", "k25", "small"])
def test_device_path_on_cpu(name: str) -> None:
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(DEVICE_SIZES)]
    assert_conforms(reference(name), device_path_on_cpu(name), images)


@pytest.mark.parametrize("name", ["k25", "small"])
def test_device_path_with_cudas_resize(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU torchvision resizes uint8 in float32, then clamps and rounds. Make both
    sides do that here, so the arithmetic CUDA runs is checked without a GPU."""
    from torchvision.transforms.v2.functional import _geometry

    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(DEVICE_SIZES)]
    native = ours(name)(images)[0]
    monkeypatch.setattr(_geometry, "_do_native_uint8_resize_on_cpu", lambda mode: False)
    monkeypatch.setattr(preprocess, "_native_uint8", lambda device: False)
    assert_conforms(reference(name), device_path_on_cpu(name), images)
    via_float = device_path_on_cpu(name)(images)[0]
    assert (native - via_float).abs().max().item() > 0  # the two resizes do differ a little


# ---------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_reference_on_cuda() -> None:
    """On CUDA both resize in float32 and round; without a resize CPU and CUDA agree exactly."""
    images = [noise_image(640, 480, seed=1), noise_image(7200, 30, seed=2), noise_image(1, 1)]
    images.append(noise_image(2100, 1700, seed=3))
    for name in ("k3", "k25"):
        mine = ours(name, device="cuda")
        pixels, grid = mine(images)
        assert pixels.device.type == "cuda" and grid.device.type == "cpu"
        expected = reference(name)(images, return_tensors="pt", device="cuda")
        assert torch.equal(grid, expected["image_grid_thw"].cpu())
        diff = (pixels - expected["pixel_values"].to("cuda")).abs().max().item()
        assert diff <= TOLERANCE, diff
        cpu_pixels, cpu_grid = ours(name)(images[:1])
        assert torch.equal(cpu_grid, grid[:1])
        assert torch.equal(cpu_pixels, pixels[: cpu_pixels.shape[0]].cpu())
