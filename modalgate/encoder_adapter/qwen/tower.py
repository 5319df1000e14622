"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower, loaded vision-only from a local directory.

Per batch it produces what the language model consumes in place of each image's placeholder
tokens: the tower's output *after* the patch merger, ``[t*h*w/merge², LM hidden]`` per image.

* **Loading** never builds or reads the language model: the tower is built on the meta
  device from ``vision_config``, and only ``visual.*`` tensors (``model.visual.*`` in
  transformers-5 / Qwen3-VL layout, unprefixed in a tower-only save) are read, from the
  shards the index names for them; a shard holding only LM weights is never opened. The
  shared helpers (shard map, shape checks, buffer init) are ``towers.vision_tower``'s.
* **Qwen3-VL** output is the merger output with the deepstack mergers' outputs concatenated
  on the last dimension, ``[tokens, hidden * (1 + len(deepstack_visual_indexes))]``: what
  vLLM's Qwen3-VL tower returns and what its ``image_embeds`` input must contain.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modalgate.encoder_adapter.towers.vision_tower import (
    EncoderLoadError,
    LoadedTower,
    check_state,
    materialise_buffers,
    read_state,
    tensor_files,
)

__all__ = ["QwenVisionEncoder"]

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
        files = tensor_files(self._path)
        wanted = {key: name for key in files if (name := self._module_name(key)) is not None}
        state, unexpected = read_state(
            files,
            wanted,
            lambda key, tensor: ((wanted[key], tensor),),
            expected,
            self._device,
            self._dtype,
        )
        check_state(self._path, state, expected, unexpected)
        module.load_state_dict(state, strict=True, assign=True)
        materialise_buffers(module, self._device)
        return tuple(sorted(wanted))

    def _module_name(self, key: str) -> str | None:
        """``visual.X`` for a tower tensor of this checkpoint, ``None`` for anything else."""
        for prefix in _VISION_PREFIXES:
            if key.startswith(prefix):
                return "visual." + key.removeprefix(prefix)
        return "visual." + key if self._tower_only else None


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
