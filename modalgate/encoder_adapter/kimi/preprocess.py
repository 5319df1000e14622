"""Kimi (MoonViT) image preprocessing: transformers' ``Kimi_K25ImageProcessor``, minus its overhead.

The reference (``transformers.models.kimi_k25.image_processing_kimi_k25``) is a
torchvision-backend processor. Per image it: converts to RGB with
``convert_to_rgb`` (a copy even for RGB images) and to a contiguous CHW uint8
tensor (a second copy); resizes to the ``navit_resize`` size with torchvision's
BICUBIC, antialiased, on that uint8 tensor (torch's native uint8 kernel on the
CPU; float32, clamp, round, back to uint8 on CUDA), skipped when the size does
not change; zero-pads the *uint8* image at the bottom and right to a multiple of
patch*merge; casts to float32 and normalises with the rescale folded into mean
and std (``(x - mean*255) / (std*255)``, so padding becomes ``-mean/std``, not 0);
patchifies with a reshape/permute copy of the float32 image; concatenates.

``KimiPreprocessor`` does the same arithmetic in the same order, so its output is
bit-identical, with less memory traffic (on the CPU):

- Pixels are read where Pillow keeps them. ``split()`` separates the channels in
  one C pass and each plane is read in place through Pillow's Arrow export
  (``modalgate.media.pillow_planes``; a copy, ``tobytes``, where that is not
  available), so no channel split is done
  in Python-land. A resize reads the image's own R, G, B, padding memory as a
  channels-last tensor: the same uint8 kernel and the same bytes as on the CHW
  copy the reference makes, about 3x faster, and it returns planes.
- The image then goes through in bands of whole patch rows, each band staying
  in cache from its first copy to its last division (image-wide passes run 3-4x
  slower here). Patchify and padding happen on uint8, 4x less data than float32:
  each patch row of a channel is ``p`` contiguous bytes in both layouts, so one
  numpy copy per plane moves them as ``p``-byte void items into patch order.
  Then the band is cast, the mean subtracted and the std divided, straight in
  its slice of the final output, preallocated once for the whole batch.
- No BatchFeature, validation layers, grouping by shape, or ``torch.cat``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from modalgate.media import pillow_planes

__all__ = ["KIMI_IMAGE_MEAN", "KIMI_IMAGE_STD", "KimiPreprocessor", "navit_size"]

# transformers' IMAGENET_STANDARD_MEAN / _STD, the Kimi_K25ImageProcessor defaults.
KIMI_IMAGE_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
KIMI_IMAGE_STD: tuple[float, float, float] = (0.5, 0.5, 0.5)
# BaseImageProcessor.rescale_factor; the reference folds it into mean and std as
# ``mean * (1.0 / rescale_factor)``, and so do we, to get the same float32 values.
_RESCALE_FACTOR = 1 / 255
# The image goes through in bands of whole patch rows, about this many patches each
# (512 x 3 x 14 x 14 is 300 kB of uint8, 1.2 MB of float32), so that a band stays in
# cache from the first copy to the last division. Image-wide passes run 3-4x slower.
_BAND_PATCHES = 512

Planes = Sequence[np.ndarray]  # R, G, B as [H, W] uint8: three arrays or one [3, H, W]


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


def _to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB, converted as transformers' ``convert_to_rgb`` converts it.

    Transparency (an alpha band, or a ``transparency`` entry, which RGB PNGs with a
    tRNS chunk have too) is composited onto white; other modes go through
    ``convert("RGB")``; RGB images are used as they are (the reference copies them).
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    if image.width < 1 or image.height < 1:
        raise ValueError(f"empty image: {image.width}x{image.height}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _hwc(image: Image.Image) -> torch.Tensor:
    """``[H, W, C]`` uint8 sharing the pixels, read-only: C is 4 (R, G, B, padding: Pillow's
    own memory) or, where that cannot be read in place, 3 (a copy). We never write to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(pillow_planes.pixels(image))


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[C, H, W]`` uint8 (any strides) to ``[C, h, w]`` uint8, as torchvision's ``resize``.

    BICUBIC with antialias. On the CPU torchvision hands the uint8 tensor to torch's
    native uint8 kernel. That kernel computes every channel on its own and gives the
    same bytes for a channels-last view of the HWC pixels (with Pillow's padding
    byte as a fourth channel, or without) as for the CHW copy the reference makes
    (the tests check it), only faster; for a batch of one it returns contiguous CHW.
    Elsewhere torchvision resizes a contiguous float32 copy, then clamps, rounds and
    casts back to uint8.
    """
    batch = image.unsqueeze(0)
    if _native_uint8(image.device):
        return _bicubic(batch, size)[0]
    resized = _bicubic(batch.contiguous().float(), size)
    return resized.clamp_(0, 255).round_().to(torch.uint8)[0]


def _native_uint8(device: torch.device) -> bool:
    """Whether torchvision resizes uint8 with the native kernel there (the CPU) or via float32."""
    return device.type == "cpu"


def _bicubic(batch: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's BICUBIC (``antialias=True``, ``align_corners=False``)."""
    return F.interpolate(batch, size=size, mode="bicubic", align_corners=False, antialias=True)


def _bands(planes: Planes, padded: tuple[int, int], p: int) -> Iterator[tuple[int, np.ndarray]]:
    """The zero-padded planes in patch order, band by band of whole patch rows.

    Yields ``(index of the band's first patch, [n, 3, p*p] uint8)``; the band is one
    small buffer, reused: use it before taking the next. Patch rows wholly inside
    the image take the short way (views made once, one copy per plane and band;
    their right padding is never written, so it stays zero); the last bands, with
    the partial patch row and the padding, go through ``_patchify``.
    """
    grid_h, grid_w = padded[0] // p, padded[1] // p
    band_rows = max(1, min(grid_h, _BAND_PATCHES // grid_w))
    inside_h = planes[0].shape[0] // p
    full_w, rest_w = divmod(planes[0].shape[1], p)
    views = [_row_views(plane[: inside_h * p], p) for plane in planes]
    patches = np.zeros((band_rows, grid_w, 3, p, p), dtype=np.uint8)
    runs = patches.view(np.dtype((np.void, p)))[..., 0]  # one item per patch row
    for top in range(0, grid_h, band_rows):
        rows = min(band_rows, grid_h - top)
        inside = max(0, min(rows, inside_h - top))
        for channel, (whole, edge) in enumerate(views):
            if whole is not None:
                np.copyto(runs[:inside, :full_w, channel], whole[top : top + inside])
            if edge is not None:
                patches[:inside, full_w, channel, :, :rest_w] = edge[top : top + inside]
        if inside < rows:
            bottom = [plane[(top + inside) * p : (top + rows) * p] for plane in planes]
            _patchify(bottom, patches[inside:rows])
        yield top * grid_w, patches[:rows].reshape(-1, 3, p * p)


def _row_views(plane: np.ndarray, p: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Views of whole patch rows of a plane (its height a multiple of ``p``), for copying
    into patch order: the whole patches as ``[rows, cols, p]`` items of ``p`` bytes, and
    the partial patches at the right edge as ``[rows, p, rest]`` bytes (None if none).

    Each patch row of one channel is ``p`` contiguous bytes in both layouts, so it moves
    as one void item: a few times faster than a byte-wise permute copy (numpy's or
    torch's), since the copy loop's cost is per item, not per byte.
    """
    rows, (cols, rest) = plane.shape[0] // p, divmod(plane.shape[1], p)
    if not rows:
        return None, None
    whole = None
    if cols:
        items = plane[:, : cols * p].reshape(rows, p, cols, p).view(np.dtype((np.void, p)))
        whole = items[..., 0].transpose(0, 2, 1)
    edge = plane[:, cols * p :].reshape(rows, p, rest) if rest else None
    return whole, edge


def _patchify(planes: Planes, patches: np.ndarray) -> None:
    """Fill ``patches`` ``[rows, cols, 3, p, p]`` uint8 with the planes, zero-padded.

    The planes (``[h, w]`` each) may be shorter and narrower than the patches cover;
    the rest is padding. Whole patches go through ``_row_views``, the partial ones
    at the right and bottom edges are copied byte-wise, and only the bytes that
    padding maps to are zeroed.
    """
    p = patches.shape[-1]
    height, width = planes[0].shape
    full_h, rest_h = divmod(height, p)
    full_w, rest_w = divmod(width, p)
    patches[full_h + (rest_h > 0) :] = 0  # patch rows below the image
    patches[:, full_w + (rest_w > 0) :] = 0  # patch columns right of it
    if rest_h:  # pixel rows below the image in the last patch row
        patches[full_h, :, :, rest_h:] = 0
    if rest_w:  # pixel columns right of it in the last patch column
        patches[:, full_w, :, :, rest_w:] = 0
    runs = patches.view(np.dtype((np.void, p)))[..., 0]  # one item per patch row
    for channel, plane in enumerate(planes):
        whole, edge = _row_views(plane[: full_h * p], p)
        if whole is not None:
            np.copyto(runs[:full_h, :full_w, channel], whole)
        if edge is not None:
            patches[:full_h, full_w, channel, :, :rest_w] = edge
        if rest_h:
            bottom = plane[full_h * p :]
            cells = bottom[:, : full_w * p].reshape(rest_h, full_w, p).transpose(1, 0, 2)
            patches[full_h, :full_w, channel, :rest_h] = cells
            if rest_w:
                patches[full_h, full_w, channel, :rest_h, :rest_w] = bottom[:, full_w * p :]


class KimiPreprocessor:
    """Images to MoonViT input: ``pixel_values [N, 3, p, p]`` float32 and ``grid_thw [images, 3]``.

    Conforms to ``Kimi_K25ImageProcessor`` built with the same settings (the
    defaults here are its defaults, i.e. Kimi-K2.5's; Kimi-K3 uses
    ``max_patches=65536``). ``max_side`` is in patches per side, as the reference's
    ``size={"max_height": ..., "max_width": ...}``.

    ``device`` (default: the CPU) is where resize, pad, normalise and patchify run
    and where ``pixel_values`` is returned; ``grid_thw`` always stays on the CPU, as
    in the reference. On CUDA the uint8 pixels are uploaded and the rest happens
    there in plain torch ops, resizing as torchvision does on CUDA (float32, clamp,
    round to uint8), which matches the reference run with ``device="cuda"``; CPU and
    CUDA resizes can differ by one grey level, as they do in the reference.
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
        # Folded exactly as the reference folds them (a float32 tensor times a Python
        # float), shaped to broadcast over one patch [3, p, p].
        self._mean = (torch.tensor(mean) * (1.0 / _RESCALE_FACTOR)).view(3, 1, 1).to(self.device)
        self._std = (torch.tensor(std) * (1.0 / _RESCALE_FACTOR)).view(3, 1, 1).to(self.device)
        # The CPU path normalises with numpy scalars holding the same float32 values:
        # once for all channels when they agree (they do for every Kimi checkpoint).
        means = self._mean.flatten().cpu().numpy()
        stds = self._std.flatten().cpu().numpy()
        self._steps: list[tuple[int | None, np.float32, np.float32]] = [
            (channel, means[channel], stds[channel]) for channel in range(3)
        ]
        if len(set(mean)) == 1 and len(set(std)) == 1:
            self._steps = [(None, means[0], stds[0])]

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
        once and every image is written into its slice.
        """
        if isinstance(images, Image.Image):
            raise TypeError("pass a list of images, not one image")
        p = self.patch_size
        rgbs = [_to_rgb(image) for image in images]
        plans = [self.sizes_for(*rgb.size) for rgb in rgbs]
        counts = [(ph // p) * (pw // p) for _, (ph, pw) in plans]
        out = torch.empty((sum(counts), 3, p, p), dtype=torch.float32, device=self.device)
        grid = torch.tensor([[1, ph // p, pw // p] for _, (ph, pw) in plans], dtype=torch.long)
        start = 0
        for rgb, (resized, padded), count in zip(rgbs, plans, counts, strict=True):
            target = out[start : start + count]
            if self.device.type == "cpu":
                self._fill_cpu(rgb, resized, padded, target)
            else:
                self._fill_device(rgb, resized, padded, target)
            start += count
        return out, grid.view(-1, 3)

    def _fill_cpu(
        self, rgb: Image.Image, resized: tuple[int, int], padded: tuple[int, int], out: torch.Tensor
    ) -> None:
        """One image into its ``[n, 3, p, p]`` slice: resize, pad, patchify, normalise,
        band by band, each band normalised in place while it is in cache."""
        p = self.patch_size
        if resized != (rgb.height, rgb.width):
            chw = _resize(_hwc(rgb).permute(2, 0, 1), resized)[:3]
            planes: Planes = np.ascontiguousarray(chw.numpy())
        else:
            planes = pillow_planes.planes(rgb)
        target = out.numpy().reshape(-1, 3, p * p)
        for first, band in _bands(planes, padded, p):
            chunk = target[first : first + len(band)]
            chunk[...] = band  # uint8 to float32, exact
            # The reference's two steps, in its order (numpy's float32 arithmetic is
            # IEEE, as torch's: same bits). One step per channel unless they agree.
            for channel, mean, std in self._steps:
                part = chunk if channel is None else chunk[:, channel]
                np.subtract(part, mean, out=part)
                np.divide(part, std, out=part)

    def _fill_device(
        self, rgb: Image.Image, resized: tuple[int, int], padded: tuple[int, int], out: torch.Tensor
    ) -> None:
        """``_fill_cpu`` in plain torch ops on ``self.device``: upload the uint8 pixels once,
        then resize, zero-pad, patchify (a permuted view read by ``torch.sub``), normalise."""
        p = self.patch_size
        image = _hwc(rgb).to(self.device).permute(2, 0, 1)[:3]  # [3, H, W] uint8
        if resized != (rgb.height, rgb.width):
            image = _resize(image, resized)
        pad_h, pad_w = padded
        canvas = torch.zeros((3, pad_h, pad_w), dtype=torch.uint8, device=self.device)
        canvas[:, : resized[0], : resized[1]] = image
        patches = canvas.view(3, pad_h // p, p, pad_w // p, p).permute(1, 3, 0, 2, 4)
        torch.sub(patches, self._mean, out=out.view(pad_h // p, pad_w // p, 3, p, p))
        out.div_(self._std)
