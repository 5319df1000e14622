"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL encoder adapter: ``--encoder qwen:DIR``.

Per image it produces what the language model consumes in place of the image's placeholder
tokens: the vision tower's output *after* the patch merger, ``[t*h*w/merge², LM hidden]``,
plus ``grid_thw`` (the patch grid before merging, as vLLM's ``image_grid_thw``). That pair is
exactly a vLLM ``image_embeds`` dict part for these models (see docs/embeds.md).

* **Preprocessing** is transformers' own image processor loaded from DIR
  (``AutoImageProcessor``: ``Qwen2VLImageProcessor``, the torchvision backend): the same code
  vLLM runs, so there is no second implementation to drift from it.
* **Loading** never builds or reads the language model: the tower is built on the meta
  device from ``vision_config``, and only ``visual.*`` tensors (``model.visual.*`` in
  transformers-5 / Qwen3-VL layout, unprefixed in a tower-only save) are read, from the
  shards the index names for them; a shard holding only LM weights is never opened. The
  shared helpers (shard map, shape checks, buffer init) are ``transformers_encoder``'s.
* **Qwen3-VL** output is the merger output with the deepstack mergers' outputs concatenated
  on the last dimension, ``[tokens, hidden * (1 + len(deepstack_visual_indexes))]``: what
  vLLM's Qwen3-VL tower returns and what its ``image_embeds`` input must contain.

Cache, decoding, batching and failure isolation are ``base.LocalImageAdapter``'s.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors import SafetensorError, safe_open
from torch import nn

from modalgate.encoder_adapter.base import LocalImageAdapter, Output
from modalgate.encoder_adapter.batching import BatchSettings
from modalgate.encoder_adapter.kimi_checkpoint import EncoderLoadError
from modalgate.encoder_adapter.transformers_encoder import (
    LoadedTower,
    _check_state,
    _materialise_buffers,
    _tensor_files,
)
from modalgate.media.decode import DEFAULT_MAX_PIXELS

__all__ = ["EncoderLoadError", "QwenEncoderAdapter", "QwenVisionEncoder", "qwen_encoder"]

_CONFIG_FILE = "config.json"
_VISION_PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True, slots=True)
class _Family:
    """Where transformers keeps one family's tower, and how wide its output rows are."""

    module: str  # transformers.models.<module>
    config_class: str
    vision_class: str
    deepstack: bool = False


_FAMILIES: dict[str, _Family] = {
    "qwen2_vl": _Family("qwen2_vl", "Qwen2VLConfig", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": _Family(
        "qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VisionTransformerPretrainedModel"
    ),
    "qwen3_vl": _Family("qwen3_vl", "Qwen3VLConfig", "Qwen3VLVisionModel", deepstack=True),
}
# A tower saved on its own carries the vision config's model_type.
_TOWER_TYPES = {f"{name}_vision": name for name in _FAMILIES}


class _QwenVisionPath(nn.Module):
    """The tower under the name checkpoints use (``visual``), so state names match them.

    A plain container (not a ``PreTrainedModel``) on purpose: ``_materialise_buffers`` runs
    ``initialize_weights`` on its ``PreTrainedModel`` children, which fills the RoPE tables.
    """

    def __init__(self, visual: nn.Module, deepstack: bool) -> None:
        super().__init__()
        self.visual = visual
        self._deepstack = deepstack

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        output = self.visual(pixel_values, grid_thw=grid_thw)
        if not self._deepstack:
            return output.pooler_output
        return torch.cat([output.pooler_output, *output.deepstack_features], dim=1)


class QwenVisionEncoder(LoadedTower):
    """A Qwen-VL tower (+ merger) loaded vision-only from a local directory, ready to ``encode``.

    ``device="auto"`` picks CUDA when available; ``dtype=None`` means bfloat16 on CUDA (what
    the checkpoints are stored in and what vLLM runs) and float32 on the CPU.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "auto",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(path, device, dtype)
        model_type, config = _load_config(self._path)
        self._tower_only = model_type in _TOWER_TYPES
        family = _FAMILIES[_TOWER_TYPES.get(model_type, model_type)]
        vision = config if self._tower_only else config.vision_config
        self.vision_config = vision
        self._merge = int(vision.spatial_merge_size)
        self._patch_width = int(vision.in_channels) * int(vision.temporal_patch_size)
        self._patch_width *= int(vision.patch_size) ** 2
        module = _build_on_meta(family, vision)
        self._checkpoint_keys = self._load_weights(module)
        module.eval().requires_grad_(False)
        self._module = module
        width = int(getattr(vision, "out_hidden_size", vision.hidden_size))
        if not self._tower_only and width != int(config.text_config.hidden_size):
            raise EncoderLoadError(
                f"{self._path}: the merger's output width {width} is not the language model's "
                f"hidden size {config.text_config.hidden_size}"
            )
        depth = len(vision.deepstack_visual_indexes) if family.deepstack else 0
        self.hidden_size = width * (1 + depth)

    @property
    def merge_size(self) -> int:
        """The spatial merge: each output row is ``merge x merge`` patches."""
        return self._merge

    def _tokens_per_image(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[int]:
        """The processor's ``pixel_values`` ``[patches, C*T*P*P]`` and ``image_grid_thw``
        ``[images, 3]`` checked; each image gives ``t*h*w/merge²`` rows."""
        if grid_thw.ndim != 2 or grid_thw.shape[1] != 3 or grid_thw.dtype.is_floating_point:
            raise ValueError(f"grid_thw must be [images, 3] integers, got {list(grid_thw.shape)}")
        if pixel_values.ndim != 2 or pixel_values.shape[1] != self._patch_width:
            raise ValueError(
                f"pixel_values must be [patches, {self._patch_width}], "
                f"got {list(pixel_values.shape)}"
            )
        merge = self._merge
        sizes = []
        for index, (t, h, w) in enumerate(grid_thw.tolist()):
            if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
                raise ValueError(
                    f"grid_thw[{index}] = {[t, h, w]}: entries must be positive and h, w "
                    f"multiples of the merge size {merge}"
                )
            sizes.append(t * h * w // merge**2)
        if sum(sizes) * merge**2 != pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw describes {sum(sizes) * merge**2} patches "
                f"but pixel_values has {pixel_values.shape[0]}"
            )
        return sizes

    def _load_weights(self, module: _QwenVisionPath) -> tuple[str, ...]:
        """Read only the tower's tensors (opening only the shards that hold them), assign them."""
        expected = module.state_dict()
        files = _tensor_files(self._path)
        wanted = {key: name for key in files if (name := self._module_name(key)) is not None}
        by_file: dict[Path, list[str]] = defaultdict(list)
        for key in wanted:
            by_file[files[key]].append(key)
        state: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        for shard, keys in sorted(by_file.items()):
            try:
                with safe_open(str(shard), framework="pt", device="cpu") as reader:
                    for key in sorted(keys):
                        name = wanted[key]
                        if name not in expected:
                            unexpected.append(key)
                            continue
                        tensor = reader.get_tensor(key)
                        state[name] = tensor.to(  # one tensor at a time: no second full copy
                            device=self._device,
                            dtype=self._dtype if tensor.is_floating_point() else None,
                        )
            except (OSError, SafetensorError) as exc:
                raise EncoderLoadError(f"{shard}: cannot read safetensors weights") from exc
        _check_state(self._path, state, expected, unexpected)
        module.load_state_dict(state, strict=True, assign=True)
        _materialise_buffers(module, self._device)
        return tuple(sorted(wanted))

    def _module_name(self, key: str) -> str | None:
        """``visual.X`` for a tower tensor of this checkpoint, ``None`` for anything else."""
        for prefix in _VISION_PREFIXES:
            if key.startswith(prefix):
                return "visual." + key.removeprefix(prefix)
        return "visual." + key if self._tower_only else None


class QwenEncoderAdapter(LocalImageAdapter):
    """``qwen:DIR``: transformers' Qwen2-VL image processor + the vision-only tower, batched."""

    name = "qwen"
    warmup_size = (64, 64)  # two 32-pixel merge windows: fits patch 14 and 16 alike

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "auto",
        batch: BatchSettings | None = None,
        cache_bytes: int = 256 * 1024 * 1024,
        decode_workers: int = 2,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.model = QwenVisionEncoder(path, device=device)
        self.processor = _load_processor(Path(path), self.model.vision_config)
        settings = self.processor.to_json_string()
        key = hashlib.blake2b(settings.encode(), digest_size=8).hexdigest()
        super().__init__(
            settings_key=f"/qwen/{key}",
            batch=batch,
            cache_bytes=cache_bytes,
            decode_workers=decode_workers,
            max_pixels=max_pixels,
        )

    def tokens_for(self, width: int, height: int) -> int:
        """Tokens the processor will give an image of this size (``smart_resize``)."""
        patches: int = self.processor.get_number_of_image_patches(height, width)
        return patches // self.model.merge_size**2

    def _patches(self, image: Image.Image) -> int:
        try:
            return int(self.processor.get_number_of_image_patches(image.height, image.width))
        except ValueError:  # a size the processor refuses: the forward fails it, alone
            return 1

    def _forward(self, images: list[Image.Image]) -> list[Output | BaseException]:
        batch = self.processor(images=images, return_tensors="pt")
        grid_thw = batch["image_grid_thw"]
        embeddings = self.model.encode(batch["pixel_values"], grid_thw)
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        return list(zip(embeddings, grids, strict=True))


def qwen_encoder(arg: str | None) -> QwenEncoderAdapter:
    """Registry factory: ``qwen:DIR`` (a Qwen2-VL/2.5-VL/3-VL checkpoint or its tower alone)."""
    if not arg:
        raise ValueError("the qwen encoder needs a checkpoint directory: --encoder qwen:DIR")
    return QwenEncoderAdapter(arg)


# ---------------------------------------------------------------------- loading helpers


def _load_config(path: Path) -> tuple[str, Any]:
    """config.json's model_type and its transformers config (local files only)."""
    if not path.is_dir():
        raise EncoderLoadError(f"encoder checkpoint directory not found: {path}")
    if not (path / _CONFIG_FILE).is_file():
        raise EncoderLoadError(f"{path}: no {_CONFIG_FILE}, not a transformers checkpoint")
    try:
        model_type = json.loads((path / _CONFIG_FILE).read_text("utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise EncoderLoadError(f"{path}: {_CONFIG_FILE} is not a readable JSON object") from exc
    family = _FAMILIES.get(_TOWER_TYPES.get(model_type, model_type))
    if family is None:
        known = ", ".join(sorted([*_FAMILIES, *_TOWER_TYPES]))
        raise EncoderLoadError(f"{path}: model_type {model_type!r} is not one of {known}")
    configs = importlib.import_module(f"transformers.models.{family.module}")
    config_class = getattr(configs, family.config_class)
    if model_type in _TOWER_TYPES:
        config_class = config_class.sub_configs["vision_config"]
    try:
        return model_type, config_class.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a malformed config
        raise EncoderLoadError(
            f"{path}: {_CONFIG_FILE} is not a valid {model_type} config"
        ) from exc


def _build_on_meta(family: _Family, vision_config: Any) -> _QwenVisionPath:
    """The tower with no storage, from ``vision_config`` alone: no language-model module."""
    modeling = importlib.import_module(
        f"transformers.models.{family.module}.modeling_{family.module}"
    )
    with torch.device("meta"):
        tower = getattr(modeling, family.vision_class)._from_config(vision_config)
    return _QwenVisionPath(tower, family.deepstack)


def _load_processor(path: Path, vision_config: Any) -> Any:
    """transformers' image processor from DIR, checked against the tower it feeds.

    A processor that patchifies at another size than the tower would give garbage (or a
    shape error per request); better to refuse at start-up.
    """
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # missing file, unknown type, malformed JSON
        raise EncoderLoadError(f"{path}: no usable image processor config") from exc
    mine = tuple(getattr(processor, k, None) for k in ("patch_size", "merge_size"))
    mine += (getattr(processor, "temporal_patch_size", None),)
    model = (
        vision_config.patch_size,
        vision_config.spatial_merge_size,
        vision_config.temporal_patch_size,
    )
    if mine != model or not hasattr(processor, "get_number_of_image_patches"):
        raise EncoderLoadError(
            f"{path}: the image processor's patch/merge/temporal sizes {list(mine)} do not "
            f"match the model's {list(model)}"
        )
    return processor
