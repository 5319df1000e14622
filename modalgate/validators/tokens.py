"""Vision-token estimates from an image's width and height alone.

A token budget must be checked before any pixel is decoded, so each estimator
repeats its model processor's resize arithmetic with plain integers and floats
(no torch, no transformers: this runs on every request). Each one is checked in
``tests/validators/test_tokens.py`` against transformers' own function over thousands of
sizes; the float expressions are written in the same order as the reference so
that rounding, and so the count, is bit-identical.

Argument order is ``(width, height, spec)``, the order image headers give;
transformers' functions take ``(height, width)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from modalgate.policy.models import TokenSpec

__all__ = [
    "ESTIMATORS",
    "TokenEstimateError",
    "estimate_tokens",
    "fixed_tokens",
    "kimi_navit_tokens",
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
}


def estimate_tokens(width: int, height: int, spec: TokenSpec) -> int | None:
    """The spec family's estimate, or ``None`` when the family has no estimator."""
    estimator = ESTIMATORS.get(spec.family)
    return None if estimator is None else estimator(width, height, spec)
