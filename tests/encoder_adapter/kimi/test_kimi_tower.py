"""TransformersVisionEncoder against transformers' own Kimi-K2.5 modules.

Every checkpoint is a tiny real model built from a config here (seeded), written with
``save_pretrained`` (safetensors) and loaded back through the encoder; the reference is the same
in-memory model's own forward. Inputs come from transformers' ``Kimi_K25ImageProcessor``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Kimi_K25ForConditionalGeneration,
    Kimi_K25ImageProcessor,
    Kimi_K25VisionModel,
)

from kimi_tiny import (
    IMAGE_SIZES,
    TEXT_HIDDEN,
    VISION_HIDDEN,
    images,
    preprocess,
    processor,
    save_full_checkpoint,
    vision_config,
)
from modalgate.encoder_adapter.kimi.tower import TransformersVisionEncoder
from modalgate.encoder_adapter.towers import vision_tower
from modalgate.encoder_adapter.towers.vision_tower import EncoderLoadError


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory) -> tuple[Path, Kimi_K25VisionModel]:
    directory = tmp_path_factory.mktemp("kimi_vision")
    torch.manual_seed(0)
    model = Kimi_K25VisionModel(vision_config()).eval()
    model.save_pretrained(directory, safe_serialization=True)
    processor().save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory) -> tuple[Path, Kimi_K25ForConditionalGeneration]:
    directory = tmp_path_factory.mktemp("kimi_full")
    return directory, save_full_checkpoint(directory)


@pytest.fixture(scope="module")
def full_encoder(full_checkpoint) -> TransformersVisionEncoder:
    return TransformersVisionEncoder(full_checkpoint[0], device="cpu")


class Reads:
    """Wraps safetensors' ``safe_open`` in the encoder module: which files, which tensors."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.tensors: list[str] = []

    def __call__(self, filename: str, *args: Any, **kwargs: Any) -> _Reader:
        self.opened.append(Path(filename).name)
        return _Reader(safe_open(filename, *args, **kwargs), self)


class _Reader:
    def __init__(self, inner: Any, reads: Reads) -> None:
        self._inner = inner
        self._reads = reads

    def __enter__(self) -> _Reader:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._inner.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        self._reads.tensors.append(key)
        return self._inner.get_tensor(key)


@pytest.fixture
def reads(monkeypatch) -> Iterator[Reads]:
    recorder = Reads()
    monkeypatch.setattr(vision_tower, "safe_open", recorder)
    yield recorder


def is_vision_key(key: str) -> bool:
    return key.removeprefix("model.").startswith(("vision_tower.", "mm_projector."))


# ---------------------------------------------------------------- 1. standalone vision model


def test_vision_model_checkpoint_matches_its_own_forward(vision_checkpoint) -> None:
    directory, model = vision_checkpoint
    encoder = TransformersVisionEncoder(directory, device="auto")  # no CUDA here: CPU, fp32
    assert encoder.device == torch.device("cpu")
    assert encoder.dtype == torch.float32
    pixel_values, grid_thw = preprocess(images())

    outputs = encoder.encode(pixel_values, grid_thw)

    with torch.no_grad():
        pooled = model(pixel_values, grid_thw).pooler_output  # [tokens, 4, hidden]
    expected = pooled.reshape(pooled.shape[0], -1).split((grid_thw[:, 1:].prod(-1) // 4).tolist())
    assert encoder.hidden_size == 4 * VISION_HIDDEN
    assert len(outputs) == len(IMAGE_SIZES)
    for (_, height, width), got, want in zip(grid_thw.tolist(), outputs, expected, strict=True):
        assert got.shape == (height // 2 * (width // 2), encoder.hidden_size)
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_preprocessor_settings_come_from_the_saved_processor(vision_checkpoint) -> None:
    encoder = TransformersVisionEncoder(vision_checkpoint[0], device="cpu")
    assert encoder.preprocessor_settings == {
        "patch_size": 14,
        "merge_size": 2,
        "max_patches": 400,
        "max_side": 24,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def test_preprocessor_settings_from_media_proc_cfg_then_defaults(
    vision_checkpoint, tmp_path
) -> None:
    hub_style = tmp_path / "hub"
    shutil.copytree(vision_checkpoint[0], hub_style)
    media = {
        "patch_size": 14,
        "merge_kernel_size": [2, 2],
        "in_patch_limit": 1024,
        "patch_limit_on_one_side": 32,
        "image_mean": [0.4, 0.4, 0.4],
        "image_std": [0.3, 0.3, 0.3],
    }
    (hub_style / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}))
    settings = TransformersVisionEncoder(hub_style, device="cpu").preprocessor_settings
    assert settings == {
        "patch_size": 14,
        "merge_size": 2,
        "max_patches": 1024,
        "max_side": 32,
        "image_mean": [0.4, 0.4, 0.4],
        "image_std": [0.3, 0.3, 0.3],
    }

    bare = tmp_path / "bare"
    shutil.copytree(vision_checkpoint[0], bare)
    (bare / "preprocessor_config.json").unlink()
    defaults = Kimi_K25ImageProcessor()
    assert TransformersVisionEncoder(bare, device="cpu").preprocessor_settings == {
        "patch_size": 14,
        "merge_size": 2,
        "max_patches": defaults.max_patches,
        "max_side": defaults.size["max_height"],
        "image_mean": list(defaults.image_mean),
        "image_std": list(defaults.image_std),
    }


# ---------------------------------------------------------------- 2. full checkpoint, no LM


def test_full_checkpoint_loads_vision_only_and_matches_get_image_features(
    full_checkpoint, reads
) -> None:
    directory, model = full_checkpoint
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    vision_keys = sorted(key for key in weight_map if is_vision_key(key))
    lm_keys = [key for key in weight_map if not is_vision_key(key)]
    vision_shards = {weight_map[key] for key in vision_keys}
    lm_only_shards = set(weight_map.values()) - vision_shards
    assert len(set(weight_map.values())) > 3 and lm_keys and lm_only_shards  # really sharded

    encoder = TransformersVisionEncoder(directory, device="cpu")

    # Only vision tower + projector tensors were read, each once; LM-only shards never opened.
    assert sorted(reads.tensors) == vision_keys
    assert len(reads.tensors) == len(set(reads.tensors))
    assert set(reads.opened) == vision_shards
    assert encoder.checkpoint_keys == tuple(vision_keys)
    names = [name for name, _ in encoder.model.named_parameters()]
    assert not [name for name in names if "language_model" in name or "lm_head" in name]
    vision_parameters = [
        *model.model.vision_tower.parameters(),
        *model.model.mm_projector.parameters(),
    ]
    assert sum(p.numel() for p in encoder.model.parameters()) == sum(
        p.numel() for p in vision_parameters
    )

    pixel_values, grid_thw = preprocess(images())
    outputs = encoder.encode(pixel_values, grid_thw)
    with torch.no_grad():
        expected = model.get_image_features(pixel_values, grid_thw).pooler_output
    assert encoder.hidden_size == TEXT_HIDDEN
    assert len(outputs) == len(expected) == len(IMAGE_SIZES)
    for (_, height, width), got, want in zip(grid_thw.tolist(), outputs, expected, strict=True):
        assert got.shape == (height // 2 * (width // 2), TEXT_HIDDEN)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as reader:
            state.update({key: reader.get_tensor(key) for key in reader.keys()})  # noqa: SIM118
    return state


def _hub_name(key: str) -> str:
    """save_pretrained's names -> the moonshotai/Kimi-K2.5 hub's (as SGLang reads them).

    transformers writes two families differently from the hub: the patch embedding lands under
    ``vision_tower.encoder.`` and the projector's pre_norm keeps a ``model.`` prefix.
    """
    key = key.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
    return key.replace("model.mm_projector.", "mm_projector.")


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_full_checkpoint_in_other_layouts(full_checkpoint, tmp_path, reads, layout) -> None:
    """transformers' module names (``model.vision_tower.layers...``) in one file, no index;
    or the hub's names, vision and LM in separate shards with an index."""
    directory, model = full_checkpoint
    model.config.save_pretrained(tmp_path)
    if layout == "transformers":
        state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        state = {_hub_name(key): value for key, value in _read_all(directory).items()}
        shards = {
            "vision.safetensors": {k: v for k, v in state.items() if is_vision_key(k)},
            "language.safetensors": {k: v for k, v in state.items() if not is_vision_key(k)},
        }
        weight_map = {}
        for name, part in shards.items():
            save_file(part, str(tmp_path / name))
            weight_map.update(dict.fromkeys(part, name))
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        assert "vision_tower.patch_embed.proj.weight" in state
        assert "mm_projector.pre_norm.weight" in state
        (tmp_path / "language.safetensors").unlink()  # an encoder host may not hold the LM

    encoder = TransformersVisionEncoder(tmp_path, device="cpu")

    assert sorted(reads.tensors) == sorted(key for key in state if is_vision_key(key))
    if layout == "hub":
        assert reads.opened == ["vision.safetensors"]
    pixel_values, grid_thw = preprocess(images())
    with torch.no_grad():
        expected = model.get_image_features(pixel_values, grid_thw).pooler_output
    for got, want in zip(encoder.encode(pixel_values, grid_thw), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bfloat16_matches_transformers_own_bfloat16_load(full_checkpoint) -> None:
    """The GPU default dtype, checked on the CPU: same weights, buffers and output as
    ``from_pretrained(dtype=bfloat16)`` (RoPE and temporal tables stay float32 in both)."""
    directory, _ = full_checkpoint
    encoder = TransformersVisionEncoder(directory, device="cpu", dtype=torch.bfloat16)
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.bfloat16
    ).eval()
    pixel_values, grid_thw = preprocess(images())
    with torch.no_grad():
        expected = reference.get_image_features(pixel_values.bfloat16(), grid_thw).pooler_output
    outputs = encoder.encode(pixel_values, grid_thw)
    for got, want in zip(outputs, expected, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


# ---------------------------------------------------------------- 3. batching


def test_mixed_batch_equals_each_image_alone(full_encoder) -> None:
    items = images()
    batch = full_encoder.encode(*preprocess(items))
    for item, together in zip(items, batch, strict=True):
        (alone,) = full_encoder.encode(*preprocess([item]))
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_encode_from_a_worker_thread_and_empty_batch(full_encoder) -> None:
    pixel_values, grid_thw = preprocess(images()[:2])
    here = full_encoder.encode(pixel_values, grid_thw)
    with ThreadPoolExecutor(max_workers=1) as worker:
        there = worker.submit(full_encoder.encode, pixel_values, grid_thw).result()
    for a, b in zip(here, there, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    empty = full_encoder.encode(torch.zeros(0, 3, 14, 14), torch.zeros(0, 3, dtype=torch.long))
    assert empty == []


@pytest.mark.parametrize(
    ("pixel_shape", "grid", "message"),
    [
        ((8, 3, 14, 14), [[1, 2, 2]], "describes 4 patches but pixel_values has 8"),
        ((4, 3, 14, 14), [[1, 1, 4]], "multiples of the merge kernel"),
        ((4, 3, 16, 16), [[1, 2, 2]], "pixel_values must be"),
        ((4, 3, 14, 14), [1, 2, 2], "grid_thw must be"),
    ],
)
def test_encode_refuses_inconsistent_inputs(full_encoder, pixel_shape, grid, message) -> None:
    with pytest.raises(ValueError, match=message):
        full_encoder.encode(torch.zeros(pixel_shape), torch.tensor(grid))


# ---------------------------------------------------------------- 4. broken checkpoints


def _copy_without(source: Path, target: Path, *names: str) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*names))
    return target


def _broken_directory(kind: str, tmp_path: Path, vision: Path, full: Path) -> Path:
    if kind == "missing":
        return tmp_path / "does-not-exist"
    if kind == "no config":
        return _copy_without(vision, tmp_path / "c", "config.json")
    if kind == "config not json":
        target = _copy_without(vision, tmp_path / "c")
        (target / "config.json").write_text("{not json")
        return target
    if kind == "other model":
        target = _copy_without(vision, tmp_path / "c")
        (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return target
    if kind == "no weights":
        return _copy_without(vision, tmp_path / "c", "*.safetensors")
    if kind == "corrupt weights":
        target = _copy_without(vision, tmp_path / "c")
        (target / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
        return target
    if kind == "vision shard gone":
        index = json.loads((full / "model.safetensors.index.json").read_text())["weight_map"]
        shard = index["mm_projector.proj.0.weight"]
        return _copy_without(full, tmp_path / "c", shard)
    if kind == "tensor missing":
        target = _copy_without(vision, tmp_path / "c", "model.safetensors")
        with safe_open(str(vision / "model.safetensors"), "pt") as reader:
            keys = [key for key in reader.keys() if "fc2" not in key]  # noqa: SIM118
            state = {key: reader.get_tensor(key) for key in keys}
        save_file(state, str(target / "model.safetensors"))
        return target
    if kind == "processor mismatch":
        target = _copy_without(vision, tmp_path / "c")
        (target / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
        return target
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "directory not found"),
        ("no config", "no config.json"),
        ("config not json", "not a readable JSON object"),
        ("other model", "model_type 'llama' is not supported"),
        ("no weights", "no safetensors weights"),
        ("corrupt weights", "cannot read safetensors weights"),
        ("vision shard gone", "cannot read safetensors weights"),
        ("tensor missing", r"lacks 4 vision tensor\(s\): vision_tower\.layers\.0\.mlp\.fc2"),
        ("processor mismatch", "do not match the model"),
    ],
)
def test_broken_checkpoint_raises_a_clear_error(
    kind, message, tmp_path, vision_checkpoint, full_checkpoint
) -> None:
    directory = _broken_directory(kind, tmp_path, vision_checkpoint[0], full_checkpoint[0])
    with pytest.raises(EncoderLoadError, match=message) as caught:
        TransformersVisionEncoder(directory, device="cpu")
    text = str(caught.value)
    assert "Traceback" not in text and "\n" not in text
