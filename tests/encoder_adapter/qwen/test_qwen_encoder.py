"""The ``qwen:DIR`` encoder adapter against transformers' own Qwen2.5-VL (and Qwen2-VL, Qwen3-VL).

Every checkpoint is a tiny real model built from a config (seeded), written with
``save_pretrained`` (sharded safetensors, the hub's key layout) next to a real
``Qwen2VLImageProcessor`` config, and loaded back through ``create_encoder("qwen:DIR")``.
The reference is the same in-memory model's ``get_image_features`` on transformers'
processor output for the same images, in one batch.

Equality is ``torch.equal`` on the CPU (float32): the adapter runs the same processor, the
same tower class with the same weights and the same batch, so the arithmetic is the same,
op for op; any difference would be a real divergence (a wrong weight, buffer, dtype or
split), not rounding. On CUDA the adapter runs bfloat16 and the check is a tolerance.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import orjson
import pybase64
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from conftest import data_url, noise_png
from modalgate.encoder_adapter import BatchSettings, available, create_encoder
from modalgate.encoder_adapter.qwen import tower as qwen_tower
from modalgate.encoder_adapter.qwen.adapter import QwenEncoderAdapter
from modalgate.encoder_adapter.towers import vision_tower
from modalgate.encoder_adapter.towers.vision_tower import EncoderLoadError
from modalgate.gateway.service.embeds import rewrite_to_embeds
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.policy.models import EmbedsSpec, TokenSpec
from modalgate.validators import validate_body
from modalgate.validators.tokens import qwen_smart_resize_tokens

TEXT_HIDDEN = 48
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64
# Non-square, tiny (upscaled to MIN_PIXELS), over MAX_PIXELS (downscaled), exact multiple.
SIZES = [(60, 45), (30, 100), (20, 20), (400, 300), (56, 112)]
ON_GPU = torch.cuda.is_available()  # the adapter's default device; bfloat16 there


def text_config(**extra: Any) -> dict[str, Any]:
    rope = {"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 10000.0}
    return {
        "vocab_size": 128,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_parameters": rope,
        **extra,
    }


def qwen25_model() -> Qwen2_5_VLForConditionalGeneration:
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "fullatt_block_indexes": [1],  # block 0 windowed, block 1 full: both paths run
        "window_size": 56,
    }
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=text_config(), vision_config=vision)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen2_model() -> Qwen2VLForConditionalGeneration:
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": TEXT_HIDDEN, "num_heads": 2}
    torch.manual_seed(1)
    config = Qwen2VLConfig(text_config=text_config(), vision_config=vision)
    return Qwen2VLForConditionalGeneration(config).eval()


def qwen3_model() -> Qwen3VLForConditionalGeneration:
    rope = {"rope_type": "default", "mrope_section": [4, 4, 4], "rope_theta": 10000.0}
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
        "patch_size": 16,
    }
    torch.manual_seed(2)
    config = Qwen3VLConfig(
        text_config=text_config(head_dim=24, rope_parameters=rope), vision_config=vision
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def processor(patch_size: int = 14) -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=patch_size
    )


def save(model: Any, directory: Path, patch_size: int = 14) -> Path:
    model.save_pretrained(directory, max_shard_size="20KB")  # many shards, LM-only ones too
    processor(patch_size).save_pretrained(directory)
    return directory


IMAGES = [noise_png(w, h, seed) for seed, (w, h) in enumerate(SIZES)]


def reference(model: Any, images: list[bytes], patch_size: int = 14) -> tuple[list, torch.Tensor]:
    """The model's own image features (deepstack concatenated) and the processor's grids."""
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    batch = processor(patch_size)(images=pil, return_tensors="pt")
    with torch.inference_mode():
        out = model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    features = list(out.pooler_output)
    if getattr(out, "deepstack_features", None):
        layers = [features, *out.deepstack_features]
        features = [torch.cat(rows, dim=1) for rows in zip(*layers, strict=True)]
    return features, batch["image_grid_thw"]


def run(adapter: QwenEncoderAdapter, work: Any) -> Any:
    async def main() -> Any:
        try:
            return await work(adapter)
        finally:
            await adapter.close()

    return asyncio.run(main())


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    if ON_GPU:
        torch.testing.assert_close(got, want.float(), rtol=5e-2, atol=5e-2)
    else:
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory) -> tuple[Path, Qwen2_5_VLForConditionalGeneration]:
    model = qwen25_model()
    return save(model, tmp_path_factory.mktemp("qwen25")), model


class Reads:
    """Wraps safetensors' ``safe_open`` where the loaders call it: which files, which tensors."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.tensors: list[str] = []

    def __call__(self, filename: str, *args: Any, **kwargs: Any) -> Any:
        self.opened.append(Path(filename).name)
        inner = safe_open(filename, *args, **kwargs)
        reads = self

        class Reader:
            def __enter__(self) -> Reader:
                inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return inner.keys()

            def get_tensor(self, key: str) -> torch.Tensor:
                reads.tensors.append(key)
                return inner.get_tensor(key)

        return Reader()


# ---------------------------------------------------------------- equality, grids, tokens


def test_embeddings_equal_get_image_features_in_one_batch(qwen25) -> None:
    directory, model = qwen25
    adapter = create_encoder(f"qwen:{directory}")  # what --encoder gives: device auto
    assert isinstance(adapter, QwenEncoderAdapter)
    results = run(adapter, lambda a: a.encode(IMAGES))
    assert adapter.batcher.batches == 1  # the reference is one batch too: same arithmetic
    expected, grids = reference(model, IMAGES)
    spec = TokenSpec(
        family="qwen_smart_resize",
        patch_size=14,
        merge_size=2,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    for (width, height), result, want, grid in zip(SIZES, results, expected, grids, strict=True):
        assert result.error is None and not result.cached
        assert_same(result.embedding, want)
        assert result.grid_thw == tuple(grid.tolist())
        t, h, w = result.grid_thw
        tokens = result.embedding.shape[0]
        assert (t, tokens, result.embedding.shape[1]) == (1, t * h * w // 4, TEXT_HIDDEN)
        # The gate's budget estimate and the adapter's batch cost agree with what it encoded.
        assert tokens == qwen_smart_resize_tokens(width, height, spec)
        assert tokens == adapter.tokens_for(width, height)
    assert {r.grid_thw for r in results} == {tuple(g.tolist()) for g in grids}  # all distinct


def test_only_the_vision_tower_is_read(qwen25, monkeypatch) -> None:
    directory, model = qwen25
    reads = Reads()
    monkeypatch.setattr(vision_tower, "safe_open", reads)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    vision_keys = sorted(key for key in weight_map if key.startswith("visual."))
    vision_shards = {weight_map[key] for key in vision_keys}
    lm_only_shards = set(weight_map.values()) - vision_shards
    assert len(lm_only_shards) > 3  # really sharded, with shards the encoder must not touch

    encoder = qwen_tower.QwenVisionEncoder(directory, device="cpu")

    assert sorted(reads.tensors) == vision_keys
    assert len(reads.tensors) == len(set(reads.tensors))
    assert set(reads.opened) == vision_shards
    assert encoder.checkpoint_keys == tuple(vision_keys)
    assert encoder.hidden_size == TEXT_HIDDEN
    names = [name for name, _ in encoder.model.named_parameters()]
    assert all(name.startswith("visual.") for name in names)
    assert sum(p.numel() for p in encoder.model.parameters()) == sum(
        p.numel() for p in model.model.visual.parameters()
    )


def test_an_encoder_host_needs_only_the_vision_shards(qwen25, tmp_path) -> None:
    directory, model = qwen25
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    keep = {name for key, name in weight_map.items() if key.startswith("visual.")}
    for file in directory.iterdir():
        if not file.name.endswith(".safetensors") or file.name in keep:
            (tmp_path / file.name).write_bytes(file.read_bytes())
    adapter = QwenEncoderAdapter(tmp_path, device="cpu", batch=BatchSettings(max_wait_ms=200))
    results = run(adapter, lambda a: a.encode(IMAGES[:2]))
    for result, want in zip(results, reference(model, IMAGES[:2])[0], strict=True):
        assert torch.equal(result.embedding, want)


def test_a_bad_image_fails_alone_and_the_cache_serves_repeats(qwen25) -> None:
    directory, model = qwen25
    good = IMAGES[0]
    adapter = QwenEncoderAdapter(directory, device="cpu")

    async def work(a: QwenEncoderAdapter) -> Any:
        await a.warmup()  # outside the queue: counts no batch, caches nothing
        first = await a.encode([good, b"\x89PNG\r\n\x1a\n broken", good])
        again = await a.encode([good])
        return first, again, a.batcher.items, a.cache.hits

    (first_good, broken, second_good), [again], model_items, hits = run(adapter, work)
    assert broken.error is not None and broken.error.code.value == "invalid_image"
    assert broken.embedding is None
    assert first_good.error is None and second_good.error is None
    assert again.cached and torch.equal(again.embedding, first_good.embedding)
    assert again.grid_thw == first_good.grid_thw
    assert (model_items, hits) == (1, 1)  # the in-request repeat and the later one skip it
    assert_same(first_good.embedding, reference(model, [good])[0][0])


def test_a_batch_that_fails_is_retried_image_by_image(qwen25, monkeypatch) -> None:
    """An image the processor refuses (aspect over 200:1) fails alone, with encoder_error."""
    directory, model = qwen25
    adapter = QwenEncoderAdapter(directory, device="cpu", batch=BatchSettings(max_wait_ms=200))
    sliver = noise_png(2000, 8, 9)
    results = run(adapter, lambda a: a.encode([IMAGES[1], sliver, IMAGES[2]]))
    assert results[1].error is not None and results[1].error.code.value == "encoder_error"
    expected, _ = reference(model, [IMAGES[1], IMAGES[2]])
    for result, want in zip([results[0], results[2]], expected, strict=True):
        assert result.error is None
        torch.testing.assert_close(result.embedding, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the rewrite


def test_rewrite_to_embeds_sends_the_adapters_tensors_and_grids(qwen25) -> None:
    directory, _ = qwen25
    images = IMAGES[:3]
    policy = parse_policy(
        f"""
models:
  - name: qwen2.5-vl
    match: ["Qwen/Qwen2.5-VL-*"]
    accepts: [image]
    encoder: "qwen:{directory}"
    embeds: {{grid_key: image_grid_thw, hidden_size: {TEXT_HIDDEN}}}
""",
        fmt="yaml",
    )
    content = [{"type": "text", "text": "compare"}] + [
        {"type": "image_url", "image_url": {"url": data_url(data)}} for data in images
    ]
    request = {"model": "Qwen/Qwen2.5-VL-7B", "messages": [{"role": "user", "content": content}]}
    verdict = validate_body(orjson.dumps(request), RuleMatcher(policy))
    assert verdict.accepted, verdict.violations
    spec = verdict.rule.embeds
    assert spec == EmbedsSpec(grid_key="image_grid_thw", hidden_size=TEXT_HIDDEN)

    async def work(adapter: QwenEncoderAdapter) -> Any:
        direct = await adapter.encode(images)
        return direct, await rewrite_to_embeds(verdict, adapter, spec)

    direct, embedded = run(create_encoder(verdict.rule.encoder), work)
    assert embedded.violations == []
    assert [location for location, _ in embedded.edits] == [
        ("messages", 0, "content", i) for i in (1, 2, 3)
    ]
    parts = orjson.loads(orjson.dumps([part for _, part in embedded.edits]))
    _, grids = reference(qwen25[1], images)
    for part, result, grid in zip(parts, direct, grids, strict=True):
        assert part["type"] == "image_embeds"
        assert set(part["image_embeds"]) == {"image_embeds", "image_grid_thw"}
        embedding = load(part["image_embeds"]["image_embeds"])
        sent_grid = load(part["image_embeds"]["image_grid_thw"])
        assert torch.equal(embedding, result.embedding)
        assert sent_grid.dtype == torch.int64 and torch.equal(sent_grid, grid)


def load(b64: str) -> torch.Tensor:
    return torch.load(io.BytesIO(pybase64.b64decode(b64, validate=True)), weights_only=True)


# ---------------------------------------------------------------- other layouts and families


def test_a_tower_saved_alone(qwen25, tmp_path) -> None:
    """``model.visual.save_pretrained``: vision config, unprefixed keys, no index."""
    _, model = qwen25
    model.model.visual.save_pretrained(tmp_path)
    processor().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_5_vl_vision"
    adapter = QwenEncoderAdapter(tmp_path, device="cpu", batch=BatchSettings(max_wait_ms=200))
    results = run(adapter, lambda a: a.encode(IMAGES))
    for result, want in zip(results, reference(model, IMAGES)[0], strict=True):
        assert torch.equal(result.embedding, want)


@pytest.mark.parametrize(
    ("build", "patch_size", "width"),
    [(qwen2_model, 14, TEXT_HIDDEN), (qwen3_model, 16, TEXT_HIDDEN * 3)],  # Qwen3: + 2 deepstack
    ids=["qwen2-vl", "qwen3-vl"],
)
def test_other_families(build, patch_size, width, tmp_path) -> None:
    model = build()
    directory = save(model, tmp_path, patch_size)
    adapter = QwenEncoderAdapter(directory, device="cpu", batch=BatchSettings(max_wait_ms=200))
    results = run(adapter, lambda a: a.encode(IMAGES))
    expected, grids = reference(model, IMAGES, patch_size)
    for result, want, grid in zip(results, expected, grids, strict=True):
        assert result.embedding.shape[1] == width
        assert torch.equal(result.embedding, want)
        assert result.grid_thw == tuple(grid.tolist())


# ---------------------------------------------------------------- refusals


def test_registry_and_factory() -> None:
    assert "qwen" in available()
    with pytest.raises(ValueError, match="qwen:DIR"):
        create_encoder("qwen")


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "directory not found"),
        ("other model", "model_type 'llama' is not one of"),
        ("no processor", "no usable image processor config"),
        ("processor mismatch", r"do not match the model's \[14, 2, 2\]"),
        ("vision shard gone", "cannot read safetensors weights"),
    ],
)
def test_broken_checkpoints_are_refused_clearly(qwen25, tmp_path, kind, message) -> None:
    source, _ = qwen25
    target = tmp_path / "c"
    if kind != "missing":
        target.mkdir()
        for file in source.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
    if kind == "other model":
        (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif kind == "no processor":
        (target / "preprocessor_config.json").unlink()
    elif kind == "processor mismatch":
        processor(16).save_pretrained(target)
    elif kind == "vision shard gone":
        index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
        (target / index["visual.merger.mlp.0.weight"]).unlink()
    with pytest.raises(EncoderLoadError, match=message) as caught:
        QwenEncoderAdapter(target, device="cpu")
    assert "\n" not in str(caught.value)
