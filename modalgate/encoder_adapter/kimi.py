"""Kimi (MoonViT) image preprocessing: transformers' ``Kimi_K25ImageProcessor``, minus its overhead.

The reference (``transformers.models.kimi_k25.image_processing_kimi_k25``) is a
torchvision-backend processor. Per image it: converts to RGB with
``convert_to_rgb`` (a copy even for RGB images), turns HWC into a contiguous CHW
uint8 tensor (a second copy), resizes with ``navit_resize`` sizes using
torchvision's BICUBIC with antialias on the uint8 tensor (torch's native uint8
kernel on the CPU; float32, clamp, round, back to uint8 on CUDA), zero-pads the
*uint8* image at the bottom and right to a multiple of patch*merge, casts to
float32, normalises with the rescale folded into mean and std
(``(x - mean*255) / (std*255)``, so padding becomes ``-mean/std``, not 0), and
patchifies with a reshape/permute copy, then concatenates the images.

``KimiPreprocessor`` does the same arithmetic in the same order, so the output is
bit-identical on the CPU, with fewer passes over memory: the uint8 pixels go from
Pillow's buffer to the padded uint8 image (no CHW copy: the resize reads the HWC
buffer as a channels-last view), then one ``torch.sub`` reads that image in patch
order and writes ``x - mean`` as float32 straight into the final, preallocated
``[N, 3, p, p]`` output, and one in-place ``div_`` finishes the whole batch. No
BatchFeature, no validation layers, no per-shape grouping, no ``torch.cat``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = ["KIMI_IMAGE_MEAN", "KIMI_IMAGE_STD", "KimiPreprocessor", "navit_size"]

# transformers' IMAGENET_STANDARD_MEAN / _STD, the Kimi_K25ImageProcessor defaults.
KIMI_IMAGE_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
KIMI_IMAGE_STD: tuple[float, float, float] = (0.5, 0.5, 0.5)
# BaseImageProcessor.rescale_factor; the reference folds it into mean and std as
# ``mean * (1.0 / rescale_factor)``, and so do we, to get the same float32 values.
_RESCALE_FACTOR = 1 / 255


def navit_size(
    height: int, width: int, patch_size: int, merge_size: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((resized_h, resized_w), (padded_h, padded_w))``, as transformers' ``navit_resize``.

    The same float operations in the same order, so the sizes agree to the pixel.
    Never upscales; one scale for both sides, truncated with ``int``, so that at
    most ``max_patches`` whole patches (counted *before* padding, so the padded
    grid can exceed it slightly) and at most ``max_side`` patches per side remain.
    ``max_side`` counts patches, not pixels (the reference's ``size["max_height"]``).
    """
    count = max(1.0, height // patch_size) * max(1.0, width // patch_size)
    side_px = max_side * patch_size
    scale = min(1.0, math.sqrt(max_patches / count), side_px / height, side_px / width)
    new_height = min(max(1, int(height * scale)), side_px)
    new_width = min(max(1, int(width * scale)), side_px)
    factor = merge_size * patch_size
    pad_height = (factor - new_height % factor) % factor + new_height
    pad_width = (factor - new_width % factor) % factor + new_width
    return (new_height, new_width), (pad_height, pad_width)


def _rgb_array(image: Image.Image) -> np.ndarray:
    """HWC uint8 pixels, converted exactly as transformers' ``convert_to_rgb`` does.

    Transparency (an alpha band, or a ``transparency`` entry, which RGB PNGs with a
    tRNS chunk have too) is composited onto white; other modes go through
    ``convert("RGB")``. A plain RGB image is read without the reference's extra copy
    (``np.asarray`` gives a read-only view of one ``tobytes`` buffer).
    """
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba).convert("RGB")
    elif image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image)


def _as_tensor(pixels: np.ndarray) -> torch.Tensor:
    """Share the (read-only) numpy buffer; we never write to it, so torch's warning is noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(pixels)


class KimiPreprocessor:
    """Images to MoonViT input: ``pixel_values [N, 3, p, p]`` float32 and ``grid_thw [images, 3]``.

    Conforms to ``Kimi_K25ImageProcessor`` built with the same settings (the
    defaults here are its defaults, i.e. Kimi-K2.5's; Kimi-K3 uses
    ``max_patches=65536``). ``max_side`` is in patches per side, as the reference's
    ``size={"max_height": ..., "max_width": ...}``.

    ``device`` (default: the CPU) is where resize, normalise and patchify run and
    where ``pixel_values`` is returned; ``grid_thw`` always stays on the CPU, as in
    the reference. On CUDA the uint8 image is uploaded and the rest happens there,
    resizing as torchvision does on CUDA (float32, clamp, round to uint8), which
    matches the reference run with ``device="cuda"``; CPU and CUDA resizes can
    differ by one grey level, as they do in the reference.
    """

    def __init__(
        self,
        patch_size: int = 14,
        merge_size: int = 2,
        max_patches: int = 16384,
        max_side: int = 512,
        image_mean: Sequence[float] = KIMI_IMAGE_MEAN,
        image_std: Sequence[float] = KIMI_IMAGE_STD,
        device: str | torch.device | None = None,
    ) -> None:
        for name, value in (
            ("patch_size", patch_size),
            ("merge_size", merge_size),
            ("max_patches", max_patches),
            ("max_side", max_side),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        mean = tuple(float(v) for v in image_mean)
        std = tuple(float(v) for v in image_std)
        if len(mean) != 3 or len(std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if not all(std):
            raise ValueError("image_std must not contain zeros")
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.max_patches = max_patches
        self.max_side = max_side
        self.image_mean = mean
        self.image_std = std
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # Folded exactly as the reference folds them (float32 tensor times a Python float),
        # shaped to broadcast over one patch [3, p, p].
        self._mean = (torch.tensor(mean) * (1.0 / _RESCALE_FACTOR)).view(3, 1, 1).to(self.device)
        self._std = (torch.tensor(std) * (1.0 / _RESCALE_FACTOR)).view(3, 1, 1).to(self.device)
        # The CPU path works on [n, 3, p*p]; when the three channels agree (they do for
        # every Kimi checkpoint) plain float scalars are faster than broadcasting and,
        # holding the same float32 values, give the same results.
        self._sub: float | torch.Tensor = self._mean.view(3, 1).cpu()
        self._div: float | torch.Tensor = self._std.view(3, 1).cpu()
        if len(set(self._mean.flatten().tolist())) == len(set(self._std.flatten().tolist())) == 1:
            self._sub, self._div = float(self._mean[0]), float(self._std[0])

    def settings_key(self) -> str:
        """A short, stable string of everything that changes the output: part of cache keys.

        The device is left out on purpose: it changes the numbers by at most a grey
        level after resizing, not what the image means to the encoder.
        """
        mean = ",".join(repr(v) for v in self.image_mean)
        std = ",".join(repr(v) for v in self.image_std)
        return (
            f"kimi-navit/p{self.patch_size}m{self.merge_size}"
            f"/mp{self.max_patches}/ms{self.max_side}/mean{mean}/std{std}"
        )

    def sizes_for(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((resized_h, resized_w), (padded_h, padded_w))`` for a ``width`` x ``height`` image."""
        return navit_size(
            height, width, self.patch_size, self.merge_size, self.max_patches, self.max_side
        )

    def grid_for(self, width: int, height: int) -> tuple[int, int, int]:
        """The image's ``grid_thw`` row: ``(1, padded_h / patch, padded_w / patch)``."""
        _, (pad_h, pad_w) = self.sizes_for(width, height)
        return 1, pad_h // self.patch_size, pad_w // self.patch_size

    def tokens_for(self, width: int, height: int) -> int:
        """Merged vision tokens (what the LLM sees) for a ``width`` x ``height`` image.

        ``h * w / merge**2`` of the grid; exact, since both sides are padded to a
        multiple of ``patch * merge``. Multiply by ``merge**2`` for encoder patches.
        """
        _, grid_h, grid_w = self.grid_for(width, height)
        return grid_h * grid_w // (self.merge_size * self.merge_size)

    @torch.inference_mode()
    def __call__(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [N, 3, p, p] float32, grid_thw [len(images), 3] int64)``.

        ``N`` is the sum of ``h * w`` over the grid rows; image ``i``'s patches follow
        image ``i - 1``'s, row-major, as in the reference. The output is allocated
        once and every image is written into its slice (no ``torch.cat``).
        """
        if isinstance(images, Image.Image):
            raise TypeError("pass a list of images, not one image")
        p = self.patch_size
        pixels = [_rgb_array(image) for image in images]
        plans = [self.sizes_for(a.shape[1], a.shape[0]) for a in pixels]
        counts = [(ph // p) * (pw // p) for _, (ph, pw) in plans]
        out = torch.empty((sum(counts), 3, p, p), dtype=torch.float32, device=self.device)
        grid = torch.tensor([[1, ph // p, pw // p] for _, (ph, pw) in plans], dtype=torch.long)
        start = 0
        for array, (resized, padded), count in zip(pixels, plans, counts, strict=True):
            target = out[start : start + count]
            if self.device.type == "cpu":
                self._fill_cpu(array, resized, padded, target)
            else:
                self._fill_device(array, resized, padded, target)
            start += count
        return out, grid.view(-1, 3)

    def _fill_cpu(
        self,
        array: np.ndarray,
        resized: tuple[int, int],
        padded: tuple[int, int],
        out: torch.Tensor,
    ) -> None:
        """One image into its ``[n, 3, p, p]`` slice: resize, pad, patchify, normalise.

        Streams the image in bands of whole patch rows through small, reused buffers,
        so nothing image-sized is allocated besides the output (big allocations cost
        page faults) and each band stays in cache from the first copy to the ``div_``.
        The layout work is done on uint8 with numpy, whose strided copies are several
        times faster than torch's here, in two steps that keep the copied runs long:
        whole patch rows of ``p`` pixels x 3 channels (moved as one ``p*3``-byte void
        item each) into patch order, then the channel split within each patch, fused
        with the cast to float32. Then the reference's ``sub_`` and ``div_``, in the
        same order, so the result is bit-identical.
        """
        p = self.patch_size
        if resized != array.shape[:2]:
            array = _resize(_as_tensor(array), resized).numpy()
        height, width = array.shape[:2]
        pad_h, pad_w = padded
        grid_h, grid_w = pad_h // p, pad_w // p
        band_rows = max(1, min(grid_h, _BAND_PATCHES // grid_w))
        canvas = np.zeros((band_rows * p, pad_w, 3), dtype=np.uint8)  # right margin stays 0
        patches = np.empty((band_rows, grid_w, p, p * 3), dtype=np.uint8)
        planar = np.empty((band_rows * grid_w, 3, p * p), dtype=np.uint8)
        planar_t = torch.from_numpy(planar)
        row = np.dtype((np.void, p * 3))  # one patch's row of pixels, all channels
        for top in range(0, grid_h, band_rows):
            n = min(band_rows, grid_h - top)
            first = min(height, top * p)
            rows = min(height, first + n * p) - first
            band = canvas[: n * p]
            band[:rows, :width] = array[first : first + rows]
            band[rows:] = 0  # bottom padding (the last band only)
            moved = patches[:n]
            source = band.reshape(n, p, grid_w, p * 3).view(row).transpose(0, 2, 1, 3)
            np.copyto(moved.view(row), source)
            np.copyto(planar[: n * grid_w], moved.reshape(n * grid_w, p * p, 3).transpose(0, 2, 1))
            chunk = out[top * grid_w : (top + n) * grid_w].view(n * grid_w, 3, p * p)
            chunk.copy_(planar_t[: n * grid_w]).sub_(self._sub).div_(self._div)

    def _fill_device(
        self,
        array: np.ndarray,
        resized: tuple[int, int],
        padded: tuple[int, int],
        out: torch.Tensor,
    ) -> None:
        """``_fill_cpu`` in torch ops on ``self.device``: upload the uint8 pixels once, then
        resize, zero-pad, patchify (a permuted view read by ``torch.sub``), normalise."""
        p = self.patch_size
        image = _as_tensor(array).to(self.device)  # [H, W, 3] uint8
        if resized != array.shape[:2]:
            image = _resize(image, resized)
        pad_h, pad_w = padded
        canvas = torch.zeros((pad_h, pad_w, 3), dtype=torch.uint8, device=self.device)
        canvas[: resized[0], : resized[1]] = image
        patches = canvas.view(pad_h // p, p, pad_w // p, p, 3).permute(0, 2, 4, 1, 3)
        planar = out.view(pad_h // p, pad_w // p, 3, p, p)
        torch.sub(patches, self._mean, out=planar)
        out.div_(self._std)


# About this many patches per band (whole patch rows): 512 x 3 x 14 x 14 float32 is
# 1.2 MB, so a band's buffers and output stay in cache between the steps.
_BAND_PATCHES = 512


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased, as torchvision's ``resize`` on a uint8 tensor; HWC in, HWC out.

    On the CPU torch has a native uint8 kernel (what torchvision picks there), and it
    reads the HWC buffer as a channels-last NCHW view without a copy. Elsewhere
    torchvision casts to float32, resizes, clamps and rounds back to uint8; we do
    the same on a contiguous NCHW copy, as it does.
    """
    nchw = image.permute(2, 0, 1).unsqueeze(0)
    if image.device.type == "cpu":
        resized = F.interpolate(
            nchw, size=size, mode="bicubic", align_corners=False, antialias=True
        )
    else:
        resized = F.interpolate(
            nchw.contiguous().float(),
            size=size,
            mode="bicubic",
            align_corners=False,
            antialias=True,
        )
        resized = resized.clamp_(0, 255).round_().to(torch.uint8)
    return resized[0].permute(1, 2, 0)
