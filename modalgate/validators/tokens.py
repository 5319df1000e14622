"""Vision-token estimates from an image's width and height alone.

A token budget must be checked before any pixel is decoded, so each estimator
repeats its model processor's resize arithmetic with plain integers and floats
(no torch, no transformers: this runs on every request). Each one is checked in
``tests/validators/test_tokens.py`` against transformers' own function over thousands of
sizes, and in ``tests/validators/test_family_processors.py`` against the full processor
on real images; the float expressions are written in the same order as the reference so
that rounding, and so the count, is bit-identical.

What is counted: the tokens the model's processor writes into the prompt for one image
and marks as image tokens (its ``image_token_ids``, what ``mm_token_type_ids`` flags):
the placeholders the encoder's features fill, plus the row breaks and image start/end
markers where the processor marks those too (Pixtral, InternVL). Llama 4's processor
marks only its one ``<|image|>`` token, so there the whole expansion is counted, as
Pixtral's is. Text the processor adds (Gemma 3's blank lines) is not counted.

Argument order is ``(width, height, spec)``, the order image headers give;
transformers' functions take ``(height, width)``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from functools import lru_cache

from modalgate.policy.models import TokenSpec

__all__ = [
    "ESTIMATORS",
    "TokenEstimateError",
    "estimate_tokens",
    "fixed_tokens",
    "glm4v_tokens",
    "internvl_tiles_tokens",
    "kimi_navit_tokens",
    "llama4_tiles_tokens",
    "openai_tiles_tokens",
    "phi4mm_tokens",
    "pixtral_tokens",
    "qwen_smart_resize_tokens",
]

# Kimi-K2.5's transformers processor (Kimi_K25ImageProcessor) class defaults.
KIMI_PATCH_SIZE = 14
KIMI_MERGE_SIZE = 2
KIMI_MAX_PATCHES = 16384
KIMI_MAX_SIDE = 512  # patches per side: size={"max_height": 512, "max_width": 512}

# Qwen2VLImageProcessor class defaults (also smart_resize()'s own defaults).
QWEN_PATCH_SIZE = 14
QWEN_MERGE_SIZE = 2
QWEN_MIN_PIXELS = 56 * 56  # 3136
QWEN_MAX_PIXELS = 28 * 28 * 1280  # 1003520
QWEN_MAX_ASPECT = 200

# Glm4vImageProcessor class defaults; an image is resized as a 2-frame clip.
GLM_PATCH_SIZE = 14
GLM_MERGE_SIZE = 2
GLM_TEMPORAL = 2
GLM_MIN_PIXELS = 112 * 112
GLM_MAX_PIXELS = 28 * 28 * 15000

# Llama4ImageProcessor / Llama4Processor defaults: 336 px tiles, 14 px patches,
# pixel shuffle 0.5 (2x2 patches per token), at most 16 tiles.
LLAMA4_TILE = 336
LLAMA4_PATCH = 14
LLAMA4_SHUFFLE = 2
LLAMA4_MAX_TILES = 16

# PixtralImageProcessor / PixtralProcessor defaults (Pixtral-12B).
PIXTRAL_PATCH = 16
PIXTRAL_LONGEST_EDGE = 1024

# Phi4MultimodalImageProcessor defaults: 448 px crops of 14 px patches, dynamic_hd 36.
PHI4_CROP = 448
PHI4_PATCH = 14
PHI4_MAX_CROPS = 36
PHI4_MIN_SIDE = 10  # the processor refuses a resize below this ("aspect ratio is very extreme")

# InternVLProcessor + GotOcr2ImageProcessor (InternVL3): 448 px tiles, 1 to 12 of them
# plus a thumbnail when there are several; 256 tokens per tile between <img> and </img>.
INTERNVL_TILE = 448
INTERNVL_MAX_TILES = 12
INTERNVL_TILE_TOKENS = 256

# OpenAI's published high-detail scheme (gpt-4o, gpt-4.1): fit in 2048x2048, shrink the
# short side to 768, count 512 px tiles; 85 tokens per image and 170 per tile.
OPENAI_TILE = 512
OPENAI_FIT = 2048
OPENAI_SHORT_SIDE = 768
OPENAI_BASE_TOKENS = 85
OPENAI_TILE_TOKENS = 170


class TokenEstimateError(ValueError):
    """The model's processor would refuse this size; the message is safe to show a client."""


def _check_size(width: int, height: int) -> None:
    # Both references divide by a side, so a zero side would crash them, not resize.
    if width < 1 or height < 1:
        raise TokenEstimateError("image width and height must be at least 1 pixel")


def kimi_navit_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from Kimi's MoonViT navit resize (transformers ``kimi_k25.navit_resize``).

    Never upscales; shrinks (one scale for both sides, truncated with ``int``)
    to fit ``max_patches`` whole patches in total and ``max_side`` patches per
    side, then pads each side up to a multiple of patch*merge. Images smaller
    than a patch are padded, not enlarged, so a 1x1 image costs one token. The
    total budget counts whole patches *before* padding, so the padded grid can
    exceed ``max_patches`` slightly; this matches the reference on purpose.
    """
    _check_size(width, height)
    patch = spec.patch_size or KIMI_PATCH_SIZE
    merge = spec.merge_size or KIMI_MERGE_SIZE
    max_patches = spec.max_patches or KIMI_MAX_PATCHES
    max_side = spec.max_side or KIMI_MAX_SIDE

    count = max(1.0, height // patch) * max(1.0, width // patch)
    scale = min(
        1.0,
        math.sqrt(max_patches / count),
        (max_side * patch) / height,
        (max_side * patch) / width,
    )
    new_height = min(max(1, int(height * scale)), max_side * patch)
    new_width = min(max(1, int(width * scale)), max_side * patch)
    factor = patch * merge
    return -(-new_height // factor) * -(-new_width // factor)


def qwen_smart_resize_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from Qwen2-VL's ``smart_resize`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL images).

    Rounds each side to a multiple of patch*merge, then rescales (floor when
    over ``max_pixels``, ceil when under ``min_pixels``). Aspect ratios above
    200:1 are refused as the reference refuses them. Sides shorter than the
    factor are *not* refused: transformers 5.x scales them up (older 4.x
    releases and qwen-vl-utils raise there; the policy's ``min_image_side``
    covers engines that pin those).
    """
    _check_size(width, height)
    patch = spec.patch_size or QWEN_PATCH_SIZE
    merge = spec.merge_size or QWEN_MERGE_SIZE
    min_pixels = spec.min_pixels or QWEN_MIN_PIXELS
    max_pixels = spec.max_pixels or QWEN_MAX_PIXELS
    factor = patch * merge

    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise TokenEstimateError(f"image aspect ratio must be at most {QWEN_MAX_ASPECT}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return (h_bar // factor) * (w_bar // factor)


def volume_smart_resize(
    height: int,
    width: int,
    frames: int,
    temporal: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    what: str,
) -> tuple[int, int]:
    """The resized sides of a clip whose pixel bounds hold for all its frames at once
    (GLM-4V's ``smart_resize``, and Qwen3-VL's video one): sides shorter than the factor
    scaled up first (truncated with ``int``), then rounded to it, then rescaled (floor
    when over ``max_pixels``, ceil when under ``min_pixels``)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise TokenEstimateError(f"{what} aspect ratio must be at most {QWEN_MAX_ASPECT}:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def glm4v_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from GLM-4.1V/4.5V's ``smart_resize`` (transformers ``glm4v``).

    Qwen's resize with two differences: sides shorter than the factor are first
    scaled up (truncated with ``int``), and the pixel bounds are checked for the
    image as a 2-frame clip, so an image may have only half of ``max_pixels``.
    """
    _check_size(width, height)
    patch = spec.patch_size or GLM_PATCH_SIZE
    merge = spec.merge_size or GLM_MERGE_SIZE
    min_pixels = spec.min_pixels or GLM_MIN_PIXELS
    max_pixels = spec.max_pixels or GLM_MAX_PIXELS
    factor = patch * merge
    h_bar, w_bar = volume_smart_resize(
        height, width, GLM_TEMPORAL, GLM_TEMPORAL, factor, min_pixels, max_pixels, "image"
    )
    return (h_bar // factor) * (w_bar // factor)


@lru_cache(maxsize=8)
def _llama4_canvases(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (rows, columns) with rows*columns <= max_tiles (``find_supported_resolutions``)."""
    return tuple(
        (rows, count // rows)
        for count in range(max_tiles, 0, -1)
        for rows in range(1, count + 1)
        if count % rows == 0
    )


def llama4_tiles_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from Llama 4's tiling (transformers ``llama4``: ``get_best_fit``, its prompt).

    The canvas is the tile grid that needs the least upscaling (or, when every
    grid shrinks the image, the least downscaling), the smallest such grid on a
    tie. The scales are float32 in the reference (torch tensors), so they are
    rounded to float32 here before they are compared. Every tile costs
    (336/14)^2/4 = 144 tokens, plus a global tile when there are several, plus
    one separator per tile and ``<|image_start|>``, ``<|image|>``, ``<|image_end|>``.
    """
    _check_size(width, height)
    tile = spec.tile_size or LLAMA4_TILE
    patch = spec.patch_size or LLAMA4_PATCH
    shuffle = spec.merge_size or LLAMA4_SHUFFLE
    canvases = _llama4_canvases(spec.max_tiles or LLAMA4_MAX_TILES)
    # float32, as torch divides an int64 tensor by an int (correctly rounded: a float64
    # quotient of two small integers rounds to the same float32 as a direct division)
    scale_h = array("f", [rows * tile / height for rows, _ in canvases])
    scale_w = array("f", [cols * tile / width for _, cols in canvases])
    scales = [w if h > w else h for h, w in zip(scale_h, scale_w, strict=True)]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    tiles = min(r * c for (r, c), s in zip(canvases, scales, strict=True) if s == chosen)
    per_tile = (tile // patch) ** 2 // shuffle**2
    if tiles == 1:
        return per_tile + 3
    return per_tile * (tiles + 1) + tiles + 3


def pixtral_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from Pixtral's resize (transformers ``pixtral``; Pixtral-12B, Mistral Small 3.x).

    Shrinks (floor) to fit ``max_side`` on the longer side, then counts blocks of
    patch*merge pixels, rounding each side up. The processor writes one
    ``[IMG]`` per block, ``[IMG_BREAK]`` after each row and ``[IMG_END]`` in
    place of the last break: rows*columns + rows tokens. An image so thin that
    its short side shrinks to 0 px leaves no row, which the processor cannot
    prompt (it fails), so it is refused.
    """
    _check_size(width, height)
    block = (spec.patch_size or PIXTRAL_PATCH) * (spec.merge_size or 1)
    longest = spec.max_side or PIXTRAL_LONGEST_EDGE
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height = math.floor(height / ratio)
        width = math.floor(width / ratio)
    rows = (height - 1) // block + 1
    cols = (width - 1) // block + 1
    if rows < 1 or cols < 1:
        raise TokenEstimateError(
            f"image aspect ratio must be at most {longest}:1 (a side shrinks to nothing)"
        )
    return rows * cols + rows


@lru_cache(maxsize=8)
def _phi4_ratios(max_crops: int) -> tuple[tuple[int, int], ...]:
    # Built and sorted as the reference builds them: a set, then sorted by area. The
    # order decides ties, and a set of int tuples iterates alike in every CPython run.
    ratios = {
        (i, j)
        for n in range(1, max_crops + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if i * j <= max_crops and i * j >= 1
    }
    return tuple(sorted(ratios, key=lambda x: x[0] * x[1]))


def phi4mm_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from Phi-4-multimodal's dynamic HD crops (transformers ``phi4_multimodal``).

    The image is cut into 448 px crops (the closest grid of at most 36 when
    more are needed), resized to fill the grid on one side and padded on the
    other; the token count is a 16x16 global view plus the unpadded part of
    the crops' 2x-downsampled 14 px patch grid, with one separator per row
    (``256 + 1 + rows*cols + rows + 16``). The processor refuses a resize that
    leaves a side under 10 px, so those shapes are refused.
    """
    _check_size(width, height)
    crop = spec.tile_size or PHI4_CROP
    patch = spec.patch_size or PHI4_PATCH
    max_crops = spec.max_tiles or PHI4_MAX_CROPS
    mask = crop // patch

    w_crops = math.ceil(width / float(crop))
    h_crops = math.ceil(height / float(crop))
    if w_crops * h_crops > max_crops:
        grid = _closest_aspect_ratio(width, height, _phi4_ratios(max_crops), crop)
    else:
        grid = (w_crops, h_crops)
    target_w, target_h = crop * grid[0], crop * grid[1]
    ratio_w = target_w / width
    ratio_h = target_h / height
    if ratio_w < ratio_h:
        new_w, new_h = target_w, int(height * ratio_w)
        pad_w, pad_h = 0, target_h - new_h
    else:
        new_w, new_h = int(width * ratio_h), target_h
        pad_w, pad_h = target_w - new_w, 0
    if min(new_h, target_h) < PHI4_MIN_SIDE or min(new_w, target_w) < PHI4_MIN_SIDE:
        raise TokenEstimateError("image aspect ratio is too extreme for this model")
    # Patch rows/columns left unmasked, then those the 2x downsampling keeps: even
    # offsets within each crop.
    rows = mask * grid[1] - (pad_h // patch if pad_h >= patch else 0)
    cols = mask * grid[0] - (pad_w // patch if pad_w >= patch else 0)
    kept = mask // 2 + mask % 2
    rows = rows // mask * kept + (rows % mask + 1) // 2
    cols = cols // mask * kept + (cols % mask + 1) // 2
    return 256 + 1 + rows * cols + rows + 16


@lru_cache(maxsize=8)
def _internvl_grids(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(columns, rows), 1 <= columns*rows <= max_tiles, by area (its aspect ratios' order)."""
    grids = [
        (cols, rows)
        for cols in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if cols * rows <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda x: x[0] * x[1]))


def internvl_tiles_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """Tokens from InternVL's dynamic tiling (transformers ``got_ocr2`` + ``internvl``).

    The grid of at most ``max_tiles`` 448 px tiles whose aspect ratio is closest
    to the image's (on a tie the larger grid, while the image covers over half
    of it); a grid of several tiles adds a thumbnail tile. Each tile is
    ``tokens_per_image`` tokens, and the processor wraps them in ``<img>`` and
    ``</img>``, which it marks as image tokens too.
    """
    _check_size(width, height)
    tile = spec.tile_size or INTERNVL_TILE
    max_tiles = spec.max_tiles or INTERNVL_MAX_TILES
    per_tile = spec.tokens_per_image or INTERNVL_TILE_TOKENS
    tiles = 1
    if max_tiles > 1:
        grid = _closest_aspect_ratio(width, height, _internvl_grids(max_tiles), tile)
        if grid[0] * grid[1] > 1:
            tiles += grid[0] * grid[1]
    return per_tile * tiles + 2


def _closest_aspect_ratio(
    width: int, height: int, grids: tuple[tuple[int, int], ...], tile: int
) -> tuple[int, int]:
    """The (columns, rows) grid whose ratio is nearest the image's; on a tie the later
    one where the image covers over half its area (``find_closest_aspect_ratio``, which
    InternVL's and Phi-4's processors share)."""
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    grid = (1, 1)
    for candidate in grids:
        diff = abs(aspect - candidate[0] / candidate[1])
        if diff < best_diff:
            best_diff = diff
            grid = candidate
        elif diff == best_diff and area > 0.5 * tile * tile * candidate[0] * candidate[1]:
            grid = candidate
    return grid


def openai_tiles_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """OpenAI's published high-detail count (gpt-4o, gpt-4.1): 85 + 170 per 512 px tile.

    The image is shrunk (never enlarged) to fit ``max_side`` square, then so
    that its short side is 768 px, and its 512 px tiles counted. The guide
    does not say how the scaled sides are rounded; they are kept exact here
    (integer arithmetic), which counts at least as many tiles as any rounding
    would, so the estimate is exact for whole-pixel sizes and an upper bound
    otherwise. ``detail: "low"`` costs only the 85; the gate does not read
    ``detail``, so it counts high detail, the most an image can cost.
    """
    _check_size(width, height)
    tile = spec.tile_size or OPENAI_TILE
    fit = spec.max_side or OPENAI_FIT
    long_side, short_side = max(width, height), min(width, height)
    num, den = 1, 1  # the scale, as an exact fraction
    if long_side > fit:
        num, den = fit, long_side
    if short_side * num > OPENAI_SHORT_SIDE * den:
        num, den = OPENAI_SHORT_SIDE, short_side
    tiles = -(-width * num // (den * tile)) * -(-height * num // (den * tile))
    return OPENAI_BASE_TOKENS + OPENAI_TILE_TOKENS * tiles


def fixed_tokens(width: int, height: int, spec: TokenSpec) -> int:
    """A constant per image, whatever its size (Gemma 3: 256).

    Gemma 3's optional pan-and-scan (off by default in transformers) adds crops
    of 256 tokens each; a deployment that turns it on is not covered here.
    """
    if spec.tokens_per_image is None:
        raise ValueError(f"token family {spec.family!r} needs tokens_per_image")
    return spec.tokens_per_image


Estimator = Callable[[int, int, TokenSpec], int]

ESTIMATORS: dict[str, Estimator] = {
    "kimi_navit": kimi_navit_tokens,
    "qwen_smart_resize": qwen_smart_resize_tokens,
    "fixed": fixed_tokens,
    "glm4v": glm4v_tokens,
    "llama4_tiles": llama4_tiles_tokens,
    "pixtral": pixtral_tokens,
    "phi4mm": phi4mm_tokens,
    "internvl_tiles": internvl_tiles_tokens,
    "openai_tiles": openai_tiles_tokens,
}


def estimate_tokens(width: int, height: int, spec: TokenSpec) -> int | None:
    """The spec family's estimate, or ``None`` when the family has no estimator."""
    estimator = ESTIMATORS.get(spec.family)
    return None if estimator is None else estimator(width, height, spec)
