"""Vision-token estimators: hand-computed sizes, and conformance with transformers.

The conformance tests compare every estimate with transformers' own processors,
built the way a user builds them, over thousands of seeded random sizes
(1xN, Nx1, tiny, up to 20000 per side, aspect ratios around the 200:1 limit,
sides at multiples of the patch factor). transformers is a test dependency on
purpose: these tests must fail, not skip, when the reference is missing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
    Qwen2VLImageProcessor,
    smart_resize,
)

from modalgate.policy.models import TokenSpec
from modalgate.validators.tokens import (
    ESTIMATORS,
    TokenEstimateError,
    estimate_tokens,
    fixed_tokens,
    kimi_navit_tokens,
    qwen_smart_resize_tokens,
)

MAX_SIDE = 20000
RANDOM_SIZES = 3000
RATIOS = ((1, 1), (4, 3), (3, 2), (16, 9), (2, 1), (3, 1), (21, 9))
SMALL_GRID = 48  # every (w, h) in 1..48 x 1..48 as well

KIMI_K3 = TokenSpec(
    family="kimi_navit", patch_size=14, merge_size=2, max_patches=65536, max_side=512
)
KIMI_K25 = TokenSpec(family="kimi_navit")  # all defaults: the K2.5 processor's
QWEN25_VL = TokenSpec(
    family="qwen_smart_resize", patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056
)
QWEN3_VL = TokenSpec(
    family="qwen_smart_resize", patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216
)
QWEN2_VL = TokenSpec(family="qwen_smart_resize")  # all defaults: Qwen2VLImageProcessor's


def sizes(seed: int, factor: int, anchors: tuple[int, ...] = ()) -> Iterator[tuple[int, int]]:
    """(width, height) pairs: a small exhaustive grid, then seeded random shapes."""
    for w in range(1, SMALL_GRID + 1):
        for h in range(1, SMALL_GRID + 1):
            yield w, h
    rng = random.Random(seed)

    def side() -> int:  # log-uniform over 1..MAX_SIDE
        return min(MAX_SIDE, max(1, round(MAX_SIDE ** rng.random())))

    def near(x: int) -> int:  # at or next to a boundary
        return min(MAX_SIDE, max(1, x + rng.randint(-2, 2)))

    kinds = ("random", "tiny", "line", "huge", "aspect", "factor", "anchor", "ratio", "ratio")
    for _ in range(RANDOM_SIZES):
        kind = rng.choice(kinds)
        if kind == "random":
            w, h = side(), side()
        elif kind == "tiny":
            w, h = rng.randint(1, 30), rng.randint(1, 30)
        elif kind == "line":
            w, h = 1, rng.randint(1, MAX_SIDE)
        elif kind == "huge":
            w, h = rng.randint(MAX_SIDE // 2, MAX_SIDE), rng.randint(MAX_SIDE // 2, MAX_SIDE)
        elif kind == "aspect":  # around 200:1, the Qwen limit
            short = rng.randint(1, MAX_SIDE // 150)
            ratio = rng.choice((200.0, 200.0 + 1 / short, rng.uniform(150.0, 250.0)))
            w, h = short, min(MAX_SIDE, round(short * ratio))
        elif kind == "ratio":  # photo shapes: exact ratios put the float math on its edges
            num, den = rng.choice(RATIOS)
            k = rng.randint(1, MAX_SIDE // num)
            w, h = k * num, k * den
        elif kind == "factor":
            w, h = near(factor * rng.randint(1, MAX_SIDE // factor)), side()
        else:
            w, h = (near(rng.choice(anchors)) if anchors else side()), side()
        yield (w, h) if rng.random() < 0.5 else (h, w)


# ------------------------------------------------------------------ conformance


KIMI_CASES = {
    "kimi-k3": (
        KIMI_K3,
        lambda: Kimi_K25ImageProcessor(
            patch_size=14,
            merge_size=2,
            max_patches=65536,
            size={"max_height": 512, "max_width": 512},
        ),
    ),
    "kimi-k2.5-defaults": (KIMI_K25, Kimi_K25ImageProcessor),
}


@pytest.mark.parametrize("name", list(KIMI_CASES))
def test_kimi_navit_matches_transformers(name: str) -> None:
    spec, make = KIMI_CASES[name]
    processor = make()
    merge = processor.merge_size
    # per-side limit in pixels, and the side of a square at the patch budget
    anchors = (512 * 14, int((processor.max_patches**0.5) * 14))
    compared = 0
    for width, height in sizes(seed=1, factor=28, anchors=anchors):
        patches = processor.get_number_of_image_patches(height, width)
        assert patches % merge**2 == 0
        assert kimi_navit_tokens(width, height, spec) == patches // merge**2, (width, height)
        compared += 1
    assert compared >= 1000


QWEN_CASES = {
    "qwen2.5-vl": (
        QWEN25_VL,
        lambda: Qwen2VLImageProcessor(
            patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056
        ),
    ),
    "qwen3-vl": (
        QWEN3_VL,
        lambda: Qwen2VLImageProcessor(
            patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216
        ),
    ),
    "qwen2-vl-defaults": (QWEN2_VL, Qwen2VLImageProcessor),
}


@pytest.mark.parametrize("name", list(QWEN_CASES))
def test_qwen_smart_resize_matches_transformers(name: str) -> None:
    spec, make = QWEN_CASES[name]
    processor = make()
    patch, merge = processor.patch_size, processor.merge_size
    factor = patch * merge
    min_pixels, max_pixels = processor.size["shortest_edge"], processor.size["longest_edge"]
    anchors = (int(max_pixels**0.5), int(min_pixels**0.5), factor // 2)
    compared = refused = 0
    for width, height in sizes(seed=2, factor=factor, anchors=anchors):
        try:
            rh, rw = smart_resize(height, width, factor, min_pixels, max_pixels)
        except ValueError:
            with pytest.raises(TokenEstimateError):
                qwen_smart_resize_tokens(width, height, spec)
            with pytest.raises(ValueError):
                processor.get_number_of_image_patches(height, width)
            refused += 1
            continue
        expected = (rh // patch) * (rw // patch) // merge**2
        assert processor.get_number_of_image_patches(height, width) == expected * merge**2
        assert qwen_smart_resize_tokens(width, height, spec) == expected, (width, height)
        compared += 1
    assert compared >= 1000
    assert refused >= 50  # the 200:1 refusals were exercised


def _grid_tokens(processor: object, width: int, height: int) -> int:
    image = torch.zeros((3, height, width), dtype=torch.uint8)
    grid = processor(images=image, return_tensors="pt")["image_grid_thw"]  # type: ignore[operator]
    t, h, w = (int(x) for x in grid[0])
    return t * h * w // processor.merge_size**2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("width", "height"),
    [(1, 1), (13, 27), (29, 28), (640, 480), (1, 9000), (9000, 3), (2100, 1900)],
)
def test_estimates_match_real_preprocessing(width: int, height: int) -> None:
    """get_number_of_image_patches() agrees with what the processors really emit."""
    for spec, make in (*KIMI_CASES.values(), *QWEN_CASES.values()):
        processor = make()
        try:
            expected = _grid_tokens(processor, width, height)
        except ValueError:
            with pytest.raises(TokenEstimateError):
                estimate_tokens(width, height, spec)
            continue
        assert estimate_tokens(width, height, spec) == expected, (spec, width, height)


# ------------------------------------------------------------------ hand-computed


@pytest.mark.parametrize(
    ("spec", "width", "height", "tokens"),
    [
        # smaller than a patch: padded to one 28x28 merge block, never upscaled
        (KIMI_K3, 1, 1, 1),
        (KIMI_K3, 29, 28, 2),  # 29 pads to 56: 2x1 blocks
        (KIMI_K3, 1000, 1000, 36 * 36),  # within budget: 1000 pads to 1008
        (KIMI_K3, 10000, 10, 256),  # per-side limit: 512 patches = 256 merged tokens
        # over the 16384-patch budget: scale 0.449, 4000 -> 1796, pads to 1820 = 65 blocks;
        # the padded grid (130x130 = 16900 patches) ends above the budget
        (KIMI_K25, 4000, 4000, 65 * 65),
        (KIMI_K3, 20000, 20000, 129 * 129),
        (QWEN25_VL, 28, 28, 4),  # under min_pixels: 28 -> 56 per side
        (QWEN25_VL, 1000, 1000, 36 * 36),  # round(1000/28) = 36
        (QWEN25_VL, 4000, 3000, 143 * 107),  # 4004 x 2996, under max_pixels
        (QWEN25_VL, 200, 1, 29),  # exactly 200:1 passes; scaled up to 812 x 28
        # over max_pixels (3584^2): beta = sqrt(3600^2 / 3584^2) must land so that
        # 3600 / beta / 28 floors to 128, not 127 (computing beta another way gives 127)
        (QWEN25_VL, 3600, 3600, 128 * 128),
        (QWEN2_VL, 2000, 2000, 35 * 35),  # over the default 1003520 px: 980 x 980
        (QWEN3_VL, 1, 1, 64),  # up to min_pixels 65536: 256 x 256, 32 px blocks
    ],
)
def test_hand_computed(spec: TokenSpec, width: int, height: int, tokens: int) -> None:
    assert estimate_tokens(width, height, spec) == tokens


@pytest.mark.parametrize(("width", "height"), [(201, 1), (1, 201), (10, 2001)])
def test_qwen_refuses_aspect_ratio_over_200(width: int, height: int) -> None:
    with pytest.raises(TokenEstimateError, match="aspect ratio"):
        qwen_smart_resize_tokens(width, height, QWEN25_VL)


@pytest.mark.parametrize("estimator", [kimi_navit_tokens, qwen_smart_resize_tokens])
@pytest.mark.parametrize(("width", "height"), [(0, 10), (10, 0), (-1, 5)])
def test_empty_sides_refused(
    estimator: Callable[[int, int, TokenSpec], int], width: int, height: int
) -> None:
    spec = KIMI_K3 if estimator is kimi_navit_tokens else QWEN25_VL
    with pytest.raises(TokenEstimateError):
        estimator(width, height, spec)


def test_fixed() -> None:
    gemma = TokenSpec(family="fixed", patch_size=14, tile_size=896, tokens_per_image=256)
    for width, height in [(1, 1), (896, 896), (20000, 3)]:
        assert fixed_tokens(width, height, gemma) == 256
        assert estimate_tokens(width, height, gemma) == 256
    with pytest.raises(ValueError, match="tokens_per_image"):
        fixed_tokens(10, 10, TokenSpec(family="fixed"))


def test_estimators_registry() -> None:
    assert set(ESTIMATORS) == {
        "kimi_navit",
        "qwen_smart_resize",
        "fixed",
        "glm4v",
        "llama4_tiles",
        "pixtral",
        "phi4mm",
        "internvl_tiles",
        "openai_tiles",
    }
    assert estimate_tokens(100, 100, TokenSpec(family="someday", tile_size=336)) is None
    assert estimate_tokens(100, 100, KIMI_K3) == kimi_navit_tokens(100, 100, KIMI_K3)
    assert TokenEstimateError.__mro__[1] is ValueError
