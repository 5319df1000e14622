"""Every built-in token family against its own model's processor, on real images.

For each rule of the built-in table whose processor transformers ships, the full
processor is built offline the way a user loads one: constructed from the
checkpoint's documented config, saved to a directory and loaded back with
``AutoProcessor.from_pretrained``. Its tokenizer is a stub (a word-level tokenizer
that knows only the model's special tokens): nothing is downloaded. Hypothesis draws
real Pillow images (size, mode, format, a second frame now and then), the gate judges
each one in a chat request under the built-in policy, and the processor runs on the
same bytes, loaded as vLLM loads them (``Image.open``, then RGB on white). For every
image:

* the gate accepts it: the processor takes it without an exception, and the gate's
  estimate (``verdict.parts[0].tokens``) equals the image tokens the processor writes
  into the prompt: the tokens its ``image_token_ids`` name (what ``mm_token_type_ids``
  flags), or for Llama 4, whose processor names only ``<|image|>``, its whole image
  expansion (``modalgate/validators/tokens.py`` says why);
* loading or processing it fails: the gate refuses it;
* the gate refuses its shape (``unsupported_image_shape``): the processor fails on it.

OpenAI's tiles have no processor; they are checked against the published formula.

``MODALGATE_FAMILY_EXAMPLES`` sets the examples per family (default 500) and
``MODALGATE_FAMILY_MAX_PIXELS`` the largest image drawn (default 1 MP, to keep the
file near a minute on one core; ``test_tokens.py`` compares sizes up to 20000 px a side
with the processors' own size arithmetic); ``benchmarks/family_processors.py`` runs 10,000
examples per family with larger images.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Any

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from conftest import body, chat, data_url, image_part
from modalgate.errors import ErrorCode
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import Verdict, validate_body
from modalgate.validators.tokens import ESTIMATORS

EXAMPLES = int(os.environ.get("MODALGATE_FAMILY_EXAMPLES", "500"))
MAX_PIXELS = int(os.environ.get("MODALGATE_FAMILY_MAX_PIXELS", str(1024 * 1024)))
MAX_SIDE = 8192

MATCHER = RuleMatcher(load_policy(), None)


# ------------------------------------------------------------------ processors


def stub_tokenizer(tokens: tuple[str, ...] = (), **named: str) -> tf.PreTrainedTokenizerFast:
    """A tokenizer that knows only special tokens; ``named`` ones become attributes
    (``tokenizer.image_token`` and ``tokenizer.image_token_id``), as in the real ones."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", extra_special_tokens=named
    )
    specials = sorted(set(tokens) | set(named.values()))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": specials}, replace_extra_special_tokens=False
    )
    return tokenizer


def _qwen_tokenizer() -> tf.PreTrainedTokenizerFast:
    return stub_tokenizer(image_token="<|image_pad|>", video_token="<|video_pad|>")


def _omni_tokenizer() -> tf.PreTrainedTokenizerFast:
    return stub_tokenizer(
        image_token="<|IMAGE|>",
        video_token="<|VIDEO|>",
        audio_token="<|AUDIO|>",
        vision_bos_token="<|vision_bos|>",
        vision_eos_token="<|vision_eos|>",
        audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
    )


def qwen_vl(processor: type, patch: int, min_pixels: int, max_pixels: int) -> Callable[[], Any]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: one ``<|image_pad|>`` per merged patch."""
    return lambda: processor(
        image_processor=tf.Qwen2VLImageProcessor(
            patch_size=patch, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels
        ),
        tokenizer=_qwen_tokenizer(),
        video_processor=tf.Qwen2VLVideoProcessor(),
    )


def qwen_omni(processor: type, patch: int) -> Callable[[], Any]:
    return lambda: processor(
        image_processor=tf.Qwen2VLImageProcessor(patch_size=patch, merge_size=2),
        video_processor=tf.Qwen2VLVideoProcessor(patch_size=patch, merge_size=2),
        feature_extractor=tf.WhisperFeatureExtractor(),
        tokenizer=_omni_tokenizer(),
    )


def kimi(max_patches: int) -> Callable[[], Any]:
    return lambda: tf.Kimi_K25Processor(
        image_processor=tf.Kimi_K25ImageProcessor(
            patch_size=14,
            merge_size=2,
            max_patches=max_patches,
            size={"max_height": 512, "max_width": 512},
        ),
        tokenizer=stub_tokenizer(image_token="<|media_pad|>", video_token="<|video_pad|>"),
        video_processor=tf.Kimi_K25VideoProcessor(),
    )


def gemma3() -> Any:
    # google/gemma-3-*-it preprocessor_config: 896x896, pan and scan off; 256 per image
    return tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessor(size={"height": 896, "width": 896}),
        tokenizer=stub_tokenizer(
            image_token="<image_soft_token>",
            boi_token="<start_of_image>",
            eoi_token="<end_of_image>",
        ),
        image_seq_length=256,
    )


LLAMA4_TOKENS = (
    "<|image|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
)


def llama4() -> Any:
    # Llama-4-Scout/Maverick: 336 px tiles, at most 16, patch 14, pixel shuffle 0.5
    return tf.Llama4Processor(
        image_processor=tf.Llama4ImageProcessor(size={"height": 336, "width": 336}, max_patches=16),
        tokenizer=stub_tokenizer(LLAMA4_TOKENS),
        patch_size=14,
        pixel_shuffle_ratio=0.5,
    )


def pixtral(patch: int, merge: int, longest_edge: int) -> Callable[[], Any]:
    return lambda: tf.PixtralProcessor(
        image_processor=tf.PixtralImageProcessor(
            patch_size={"height": patch, "width": patch}, size={"longest_edge": longest_edge}
        ),
        tokenizer=stub_tokenizer(("[IMG]", "[IMG_BREAK]", "[IMG_END]")),
        patch_size=patch,
        spatial_merge_size=merge,
    )


def phi4mm() -> Any:
    # microsoft/Phi-4-multimodal-instruct: 448 px crops, patch 14, dynamic_hd 36
    return tf.Phi4MultimodalProcessor(
        image_processor=tf.Phi4MultimodalImageProcessor(
            size={"height": 448, "width": 448}, patch_size=14, dynamic_hd=36
        ),
        audio_processor=tf.Phi4MultimodalFeatureExtractor(),
        tokenizer=stub_tokenizer(image_token="<|endoftext10|>", audio_token="<|endoftext11|>"),
    )


def internvl3() -> Any:
    # OpenGVLab/InternVL3-*-hf: GotOcr2ImageProcessor, 448 px tiles, 1..12 plus thumbnail
    return tf.InternVLProcessor(
        image_processor=tf.GotOcr2ImageProcessor(
            size={"height": 448, "width": 448},
            crop_to_patches=True,
            min_patches=1,
            max_patches=12,
        ),
        tokenizer=stub_tokenizer(
            start_image_token="<img>",
            end_image_token="</img>",
            context_image_token="<IMG_CONTEXT>",
            video_token="<video>",
        ),
        video_processor=tf.InternVLVideoProcessor(),
        image_seq_length=256,
    )


def glm4v() -> Any:
    # Glm4vImageProcessor class defaults, which the built-in rule records
    return tf.Glm4vProcessor(
        image_processor=tf.Glm4vImageProcessor(
            size={"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000},
            patch_size=14,
            merge_size=2,
        ),
        tokenizer=stub_tokenizer(image_token="<|image|>", video_token="<|video|>"),
        video_processor=tf.Glm4vVideoProcessor(),
    )


@dataclass(frozen=True)
class Family:
    """One built-in rule and the processor its model ships with."""

    model: str  # a name the built-in table maps to the rule
    rule: str  # the rule it must resolve to
    token_family: str
    build: Callable[[], Any]
    placeholder: str  # what the chat template writes for one image
    counted: tuple[str, ...] = ()  # token strings counted; () = the processor's image_token_ids
    factor: int = 28  # the size quantum: sides at its multiples are drawn
    anchors: tuple[int, ...] = ()  # sides where the resize changes branch


QWEN_PAD = "<|image_pad|>"
FAMILIES: dict[str, Family] = {
    "qwen2-vl": Family(
        "Qwen/Qwen2-VL-7B-Instruct",
        "qwen2-vl",
        "qwen_smart_resize",
        qwen_vl(tf.Qwen2VLProcessor, 14, 56 * 56, 28 * 28 * 1280),
        QWEN_PAD,
        anchors=(1002, 56, 14),
    ),
    "qwen2.5-vl": Family(
        "Qwen/Qwen2.5-VL-7B-Instruct",
        "qwen2.5-vl",
        "qwen_smart_resize",
        qwen_vl(tf.Qwen2_5_VLProcessor, 14, 3136, 12845056),
        QWEN_PAD,
        anchors=(3584, 56, 14),
    ),
    "qwen3-vl": Family(
        "Qwen/Qwen3-VL-8B-Instruct",
        "qwen3-vl",
        "qwen_smart_resize",
        qwen_vl(tf.Qwen3VLProcessor, 16, 65536, 16777216),
        QWEN_PAD,
        factor=32,
        anchors=(4096, 256, 16),
    ),
    "qwen2.5-omni": Family(
        "Qwen/Qwen2.5-Omni-7B",
        "qwen2.5-omni",
        "qwen_smart_resize",
        qwen_omni(tf.Qwen2_5OmniProcessor, 14),
        "<|IMAGE|>",
        anchors=(1002, 56, 14),
    ),
    "qwen3-omni": Family(
        "Qwen/Qwen3-Omni-30B-A3B-Instruct",
        "qwen3-omni",
        "qwen_smart_resize",
        qwen_omni(tf.Qwen3OmniMoeProcessor, 16),
        "<|IMAGE|>",
        factor=32,
        anchors=(1002, 56, 16),
    ),
    "kimi-k2.5": Family(
        "moonshotai/Kimi-K2.5",
        "kimi-k2.5",
        "kimi_navit",
        kimi(16384),
        "<|media_pad|>",
        anchors=(7168, 1792, 14),
    ),
    "kimi-k3": Family(
        "moonshotai/Kimi-K3",
        "kimi-k3",
        "kimi_navit",
        kimi(65536),
        "<|media_pad|>",
        anchors=(7168, 3584, 14),
    ),
    "gemma-3": Family(
        "google/gemma-3-27b-it", "gemma-3", "fixed", gemma3, "<start_of_image>", anchors=(896,)
    ),
    "llama-4": Family(
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        "llama-4",
        "llama4_tiles",
        llama4,
        "<|image|>",
        counted=LLAMA4_TOKENS,
        factor=336,
        anchors=(336, 672, 1344, 5376),
    ),
    "pixtral-12b": Family(
        "mistralai/Pixtral-12B-2409",
        "pixtral-12b",
        "pixtral",
        pixtral(16, 1, 1024),
        "[IMG]",
        factor=16,
        anchors=(1024, 1025),
    ),
    "mistral-small-3.1": Family(
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
        "mistral-small-3.1",
        "pixtral",
        pixtral(14, 2, 1540),
        "[IMG]",
        anchors=(1540, 1541),
    ),
    "phi-4-multimodal": Family(
        "microsoft/Phi-4-multimodal-instruct",
        "phi-4-multimodal",
        "phi4mm",
        phi4mm,
        "<|endoftext10|>",
        factor=448,
        anchors=(10, 448, 2688),
    ),
    "internvl3": Family(
        "OpenGVLab/InternVL3-8B",
        "internvl3",
        "internvl_tiles",
        internvl3,
        "<IMG_CONTEXT>",
        factor=448,
        anchors=(448, 896),
    ),
    "glm-4.5v": Family(
        "zai-org/GLM-4.5V",
        "glm-4.5v",
        "glm4v",
        glm4v,
        "<|image|>",
        anchors=(2424, 112, 28),
    ),
}


@cache
def processor_for(name: str) -> tuple[Any, frozenset[int]]:
    """The family's processor as ``AutoProcessor`` loads it back, and the ids counted."""
    family = FAMILIES[name]
    with tempfile.TemporaryDirectory() as tmp:
        family.build().save_pretrained(tmp)
        processor = tf.AutoProcessor.from_pretrained(tmp)
    if family.counted:
        ids = processor.tokenizer.convert_tokens_to_ids(list(family.counted))
    else:
        ids = processor.image_token_ids
    assert None not in ids and processor.tokenizer.unk_token_id not in ids
    return processor, frozenset(ids)


def load_like_vllm(data: bytes) -> Image.Image:
    """vLLM's ``ImageMediaIO.load_bytes``: the first frame, in RGB, RGBA flattened on white."""
    image = Image.open(io.BytesIO(data))
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode == "RGBA":
        flat = Image.new("RGB", image.size, (255, 255, 255))
        flat.paste(image, mask=image.split()[3])
        return flat
    return image.convert("RGB")


def processor_tokens(name: str, data: bytes) -> int:
    """The image tokens the full processor writes for the image; raises where it fails."""
    processor, ids = processor_for(name)
    image = load_like_vllm(data)
    text = f"look {FAMILIES[name].placeholder} here"
    out = processor(text=[text], images=[image])
    input_ids = out["input_ids"][0]
    input_ids = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
    return sum(1 for token in input_ids if token in ids)


# ------------------------------------------------------------------ images

MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MODES = {
    "PNG": ("RGB", "RGBA", "L", "LA", "P", "1", "I;16"),
    "JPEG": ("RGB", "L", "CMYK"),
    "WEBP": ("RGB", "RGBA"),
    "GIF": ("P", "L"),
}


@dataclass(frozen=True)
class Case:
    width: int
    height: int
    fmt: str
    mode: str
    frames: int
    color: int

    def encode(self) -> bytes:
        size = (self.width, self.height)
        bands = Image.getmodebands(self.mode)
        first = Image.new(self.mode, size, self.color if bands == 1 else (self.color,) * bands)
        buffer = io.BytesIO()
        if self.frames > 1:
            second = Image.new(self.mode, size, 0 if bands == 1 else (0,) * bands)
            first.save(buffer, self.fmt, save_all=True, append_images=[second], duration=40)
        else:
            first.save(buffer, self.fmt)
        return buffer.getvalue()


def _fit(width: int, height: int) -> tuple[int, int]:
    """Clamp to the run's side and pixel caps, shrinking the longer side."""
    width, height = max(1, min(MAX_SIDE, width)), max(1, min(MAX_SIDE, height))
    if width * height > MAX_PIXELS:
        if width >= height:
            width = max(1, MAX_PIXELS // height)
        else:
            height = max(1, MAX_PIXELS // width)
    return width, height


def _log_side(low: int) -> st.SearchStrategy[int]:
    """low..8192, log-uniform: most images are small, as the time budget needs."""
    return st.integers(0, 1300).map(lambda e: low - 1 + max(1, round(2 ** (e / 100))))


@st.composite
def sizes(draw: st.DrawFn, f: int, anchors: tuple[int, ...], low: int = 1) -> tuple[int, int]:
    """(width, height): log-uniform from ``low`` (the rule's smallest side), at multiples of
    ``f``, near ``anchors``; or tiny, thin, or photo-shaped."""
    near = st.builds(lambda x, d: x + d, st.sampled_from(anchors or (f,)), st.integers(-2, 2))
    multiple = st.builds(
        lambda k, d: k * f + d,
        _log_side(1).map(lambda k: min(k, max(1, 4096 // f))),
        st.integers(-1, 1),
    )
    side = st.one_of(st.integers(low, low + 64), _log_side(low), multiple, near)
    kind = draw(st.sampled_from(("sides",) * 5 + ("tiny", "thin", "ratio", "ratio")))
    if kind == "tiny":  # below the rule's smallest side too
        width, height = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    elif kind == "thin":  # aspect ratios around the refusals (200:1, 1024:1, Phi-4's 10 px)
        short = draw(st.integers(1, max(40, low + 12)))
        ratio = draw(st.one_of(st.integers(100, 260), st.integers(260, 1600)))
        width, height = short, short * ratio + draw(st.integers(-3, 3))
    elif kind == "ratio":  # photo shapes: exact ratios put the float arithmetic on its edges
        num, den = draw(st.sampled_from(((1, 1), (4, 3), (3, 2), (16, 9), (2, 1), (21, 9))))
        k = min(draw(_log_side(-(-low // den))), 4096 // num)
        width, height = k * num, k * den
    else:
        width, height = draw(side), draw(side)
    if draw(st.booleans()):
        width, height = height, width
    return _fit(width, height)


@st.composite
def cases(draw: st.DrawFn, family: Family) -> Case:
    low = MATCHER.resolve(family.model).limits.min_image_side
    width, height = draw(sizes(family.factor, family.anchors, low))
    fmt = draw(st.sampled_from(tuple(MIME)))
    if fmt == "WEBP":  # WebP's own side limit; larger ones cannot be written
        width, height = min(width, 16383), min(height, 16383)
    mode = draw(st.sampled_from(MODES[fmt]))
    # one in twenty animated (the gate refuses those); a value Hypothesis does not favour
    frames = 2 if fmt != "JPEG" and draw(st.integers(0, 19)) == 9 else 1
    return Case(width, height, fmt, mode, frames, draw(st.integers(0, 255)))


def gate(model: str, case: Case, data: bytes) -> Verdict:
    request = chat(image_part(data_url(data, MIME[case.fmt])), model=model)
    return validate_body(body(request), MATCHER)


def run_family(name: str, examples: int) -> Counter[str]:
    """The three properties over ``examples`` drawn images; what was seen, by outcome."""
    family = FAMILIES[name]
    processor_for(name)  # built before the clock starts
    seen: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=cases(family))
    def check(case: Case) -> None:
        data = case.encode()
        verdict = gate(family.model, case, data)
        assert verdict.rule is not None and verdict.rule.name == family.rule
        codes = {v.code for v in verdict.violations}
        seen.update(f"code:{code.value}" for code in codes)
        if codes and ErrorCode.UNSUPPORTED_IMAGE_SHAPE not in codes:
            seen["refused"] += 1  # refused before the estimate: nothing of it to compare
            return
        try:
            expected: int | None = processor_tokens(name, data)
        except Exception:  # any failure of loading or processing: the gate must refuse
            expected = None
        if verdict.accepted:
            assert expected is not None, f"{case}: the gate accepted what the processor fails on"
            assert verdict.parts[0].tokens == expected, case
            seen["compared"] += 1
            return
        assert expected is None, f"{case}: refused as a shape the processor takes"
        seen["refused"] += 1
        seen["refused_shape"] += 1

    with torch.inference_mode():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            check()
        finally:
            torch.set_num_threads(threads)
    return seen


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_processor(name: str) -> None:
    seen = run_family(name, EXAMPLES)
    # The run compared most images, and refused some (formats, frames, sizes, shapes).
    assert seen["compared"] >= EXAMPLES // 2, seen
    assert seen["refused"] >= 1, seen


def test_every_estimated_builtin_family_is_checked() -> None:
    """A family added to the built-in table without a check here fails this test."""
    policy = load_policy()
    estimated = [rule.tokens for rule in policy.models if rule.tokens]
    families = {tokens.family for tokens in estimated if tokens.family in ESTIMATORS}
    checked = {family.token_family for family in FAMILIES.values()} | {"openai_tiles"}
    # kimi-vl's processor (MoonViT) is remote code, not in transformers: it shares
    # kimi_navit with K2.5 and K3, which are checked.
    assert families == checked


# ------------------------------------------------------------------ OpenAI tiles


def published_openai_tiles(width: int, height: int, rounding: Callable[[Fraction], int]) -> int:
    """OpenAI's "Images and vision" guide, high detail, step by step, scaled sides rounded
    with ``rounding`` (the guide does not say how)."""
    w, h = Fraction(width), Fraction(height)
    if max(w, h) > 2048:  # 1. fit within a 2048 x 2048 square
        scale = Fraction(2048) / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > 768:  # 2. the shortest side becomes 768 px
        scale = Fraction(768) / min(w, h)
        w, h = w * scale, h * scale
    w, h = Fraction(rounding(w)), Fraction(rounding(h))
    return 85 + 170 * math.ceil(w / 512) * math.ceil(h / 512)  # 3. 170 per 512 px tile


OPENAI_MODELS = ("gpt-4o", "gpt-4o-mini", "gpt-4.1-2025-04-14")


def run_openai(examples: int) -> Counter[str]:
    """The gate's count for OpenAI's tile models against the guide's formula."""
    seen: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(size=sizes(512, (512, 768, 1024, 2048), 2), model=st.sampled_from(OPENAI_MODELS))
    def check(size: tuple[int, int], model: str) -> None:
        width, height = size
        case = Case(width, height, "PNG", "L", 1, 7)
        verdict = gate(model, case, case.encode())
        if min(size) < 2:  # the default smallest side, before any estimate
            assert [v.code for v in verdict.violations] == [ErrorCode.IMAGE_TOO_SMALL]
            seen["refused"] += 1
            return
        assert verdict.accepted, verdict.violations
        tokens = verdict.parts[0].tokens
        # exact where the scaled sides come out whole (ceil), at least any rounding's count
        assert tokens == published_openai_tiles(width, height, math.ceil), size
        assert tokens >= published_openai_tiles(width, height, math.floor), size
        assert tokens >= published_openai_tiles(width, height, round), size
        seen["compared"] += 1

    check()
    return seen


def test_openai_tiles_follow_the_published_formula() -> None:
    seen = run_openai(EXAMPLES)
    assert seen["compared"] >= EXAMPLES // 2, seen
