"""The local Kimi-K2.5 vision encoder: transformers' modules, our own (vision-only) loading.

``TransformersVisionEncoder`` turns what ``Kimi_K25ImageProcessor`` produces (``pixel_values``
plus ``image_grid_thw``) into one embedding matrix per image. It reads two kinds of checkpoint
directory:

* a standalone ``Kimi_K25VisionModel`` (``model_type: kimi_k25_vision``): MoonViT alone, no
  projector. Each output row is one merged token: the ``kh*kw`` patch features of a merge window
  concatenated (``pooler_output`` ``[tokens, kh*kw, hidden]`` flattened to
  ``[tokens, kh*kw*hidden]``), which is exactly what the projector would consume.
* a full ``Kimi_K25ForConditionalGeneration`` checkpoint (``model_type: kimi_k25``): the
  vision tower plus ``mm_projector``; each output row is an LM-space embedding
  (``text_config.hidden_size``), the same as ``get_image_features``. Like SGLang's encoder-only
  server, we never build the language model: the modules are built on the meta device from the
  config, and only tensors whose names start with a vision prefix are read from the safetensors
  shards (the shard index tells which files to open; LM-only shards are never opened).

Why not ``from_pretrained``: for a full checkpoint it would build and read the whole
language model (a trillion parameters for Kimi-K2.5) to get a 400M-parameter tower. So the
weight renaming that transformers applies on load (``conversion_mapping.py``, ``kimi_k25``) is
redone here for the vision keys only. Two layouts exist on disk and both are accepted:

* the original (hub / SGLang) layout, which ``save_pretrained`` also writes back:
  ``vision_tower.[encoder.]patch_embed.*``, ``vision_tower.encoder.blocks.N.{norm0,norm1,wqkv,wo,
  mlp.fc0,mlp.fc1}``, ``vision_tower.patch_embed.pos_emb.weight``, ``mm_projector.pre_norm``,
  ``mm_projector.proj.{0,2}`` (sometimes ``model.``-prefixed). ``wqkv`` is split into q/k/v and
  q/k are permuted from interleaved (complex) RoPE to transformers' rotate-half layout.
* transformers' module names: ``[model.]vision_tower.layers.N.attn.q_proj...``,
  ``[model.]mm_projector.in_proj...`` (what ``safetensors.torch.save_file(model.state_dict())``
  writes).

Where it runs, the batched forward and the shard bookkeeping are ``towers.vision_tower``'s,
shared with the Qwen tower; this module adds Kimi's config, modules and weight names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modalgate.encoder_adapter.kimi.checkpoint import preprocessor_settings
from modalgate.encoder_adapter.kimi.layout import (
    ORIGINAL_LAYOUT_MARKER,
    component_of,
    renamed,
    strip_encoder,
)
from modalgate.encoder_adapter.towers.vision_tower import (
    EncoderLoadError,
    LoadedTower,
    check_state,
    materialise_buffers,
    read_state,
    tensor_files,
)

__all__ = ["EncoderLoadError", "TransformersVisionEncoder"]

_CONFIG_FILE = "config.json"

_FULL_MODEL_TYPE = "kimi_k25"
_VISION_MODEL_TYPE = "kimi_k25_vision"


class _KimiVisionPath(nn.Module):
    """Vision tower plus projector, without the language model: ``get_image_features``'s body.

    Mirrors ``Kimi_K25Model.get_image_features`` (tower -> ``pooler_output`` ``[tokens, k, h]``
    -> ``mm_projector`` -> ``[tokens, text_hidden]``); the test pins the two to each other.
    """

    def __init__(self, vision_tower: nn.Module, mm_projector: nn.Module | None) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.mm_projector = mm_projector

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        pooled = self.vision_tower(pixel_values, grid_thw=grid_thw).pooler_output
        if self.mm_projector is None:
            return pooled.reshape(pooled.shape[0], -1)
        return self.mm_projector(pooled).squeeze(1)


class TransformersVisionEncoder(LoadedTower):
    """Kimi-K2.5 MoonViT (+ projector) loaded from a local directory, ready to ``encode``.

    ``device="auto"`` picks CUDA when available; ``dtype=None`` means bfloat16 on CUDA (what the
    checkpoints are stored in and what SGLang runs) and float32 elsewhere (CPU bf16 is slow and
    the tests compare against float32 references).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "auto",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(path, device, dtype)
        config = _load_config(self._path)
        self._config = config
        is_full = config.model_type == _FULL_MODEL_TYPE
        vision_config = config.vision_config if is_full else config
        kernel = tuple(int(k) for k in vision_config.merge_kernel_size)
        if len(kernel) != 2:
            raise EncoderLoadError(
                f"{self._path}: merge_kernel_size must have two entries, got {kernel}"
            )
        self._merge_kernel: tuple[int, int] = (kernel[0], kernel[1])
        self._patch_size = int(vision_config.patch_size)

        module = _build_on_meta(config, is_full)
        self._checkpoint_keys = self._load_weights(module, is_full)
        module.eval().requires_grad_(False)
        self._module = module

        if is_full:
            self._hidden_size = int(config.text_config.hidden_size)
        else:
            self._hidden_size = int(vision_config.hidden_size) * kernel[0] * kernel[1]
        self._preprocessor = preprocessor_settings(self._path, config, vision_config)
        self._check_preprocessor_matches_model()

    # ------------------------------------------------------------------ properties

    @property
    def hidden_size(self) -> int:
        """Width of each output row: ``text_config.hidden_size`` with a projector, else
        ``kh*kw*vision hidden`` (the merged-window features the projector would take)."""
        return self._hidden_size

    @property
    def preprocessor_settings(self) -> dict[str, Any]:
        """patch_size, merge_size, max_patches, max_side (in patches), image_mean, image_std.

        Precedence per field: the checkpoint's preprocessor config (``media_proc_cfg`` of the hub
        format, or transformers' ``Kimi_K25ImageProcessor`` keys), then the model config, then
        ``Kimi_K25ImageProcessor``'s defaults. A fresh dict each time, so callers may keep it.
        """
        return {
            key: list(value) if isinstance(value, list) else value
            for key, value in self._preprocessor.items()
        }

    def _tokens_per_image(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[int]:
        """``Kimi_K25ImageProcessor``'s ``pixel_values`` ``[patches, 3, p, p]`` and ``grid_thw``
        ``[images, 3]`` checked; each image gives ``(h/kh)*(w/kw)`` rows (a clip's frames are
        pooled)."""
        if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [images, 3], got {list(grid_thw.shape)}")
        if grid_thw.dtype.is_floating_point or grid_thw.dtype == torch.bool:
            raise ValueError(f"grid_thw must hold integers, got {grid_thw.dtype}")
        patch = self._patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, patch, patch):
            raise ValueError(
                f"pixel_values must be [patches, 3, {patch}, {patch}], "
                f"got {list(pixel_values.shape)}"
            )
        kh, kw = self._merge_kernel
        sizes: list[int] = []
        patches = 0
        for index, (t, h, w) in enumerate(grid_thw.tolist()):
            if t < 1 or h < 1 or w < 1 or h % kh or w % kw:
                raise ValueError(
                    f"grid_thw[{index}] = {[t, h, w]}: each entry must be positive and h, w "
                    f"multiples of the merge kernel {kh}x{kw}"
                )
            patches += t * h * w
            sizes.append((h // kh) * (w // kw))
        if patches != pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw describes {patches} patches but pixel_values has {pixel_values.shape[0]}"
            )
        return sizes

    # ------------------------------------------------------------------ loading

    def _load_weights(self, module: _KimiVisionPath, is_full: bool) -> tuple[str, ...]:
        """Read only the vision/projector tensors, rename them to module names, assign them."""
        expected = module.state_dict()
        files = tensor_files(self._path)  # checkpoint key -> shard path
        wanted = {key: component_of(key, is_full) for key in files}
        wanted = {key: split for key, split in wanted.items() if split is not None}
        tower_keys = [rest for component, rest in wanted.values() if component == "vision_tower"]
        original_layout = any(
            ORIGINAL_LAYOUT_MARKER.search(strip_encoder(rest)) for rest in tower_keys
        )
        config = self._config.vision_config if is_full else self._config
        num_heads = int(config.num_attention_heads)

        def rename(key: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
            component, rest = wanted[key]
            for name, value in renamed(component, rest, tensor, original_layout, num_heads):
                yield f"{component}.{name}", value

        state, unexpected = read_state(files, wanted, rename, expected, self._device, self._dtype)

        check_state(self._path, state, expected, unexpected)
        module.load_state_dict(state, strict=True, assign=True)
        materialise_buffers(module, self._device)
        return tuple(sorted(wanted))

    def _check_preprocessor_matches_model(self) -> None:
        """A preprocessor that patchifies at another size than the model would give garbage."""
        settings = self._preprocessor
        kh, kw = self._merge_kernel
        merge = settings["merge_size"]
        if settings["patch_size"] != self._patch_size or (kh, kw) != (merge, merge):
            raise EncoderLoadError(
                f"{self._path}: preprocessor patch_size/merge_size "
                f"{settings['patch_size']}/{settings['merge_size']} do not match the model's "
                f"{self._patch_size}/{kh}x{kw}"
            )


# ---------------------------------------------------------------------- helpers


def _load_config(path: Path) -> Any:
    """Parse config.json with transformers (local only) and check it is a Kimi-K2.5 one."""
    if not path.is_dir():
        raise EncoderLoadError(f"encoder checkpoint directory not found: {path}")
    if not (path / _CONFIG_FILE).is_file():
        raise EncoderLoadError(f"{path}: no {_CONFIG_FILE}, not a transformers checkpoint")
    try:
        model_type = json.loads((path / _CONFIG_FILE).read_text("utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise EncoderLoadError(f"{path}: {_CONFIG_FILE} is not a readable JSON object") from exc
    if model_type not in (_FULL_MODEL_TYPE, _VISION_MODEL_TYPE):
        raise EncoderLoadError(
            f"{path}: model_type {model_type!r} is not supported; "
            f"expected {_FULL_MODEL_TYPE!r} or {_VISION_MODEL_TYPE!r}"
        )
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

    config_class = Kimi_K25Config if model_type == _FULL_MODEL_TYPE else Kimi_K25VisionConfig
    try:
        return config_class.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a malformed config
        raise EncoderLoadError(
            f"{path}: {_CONFIG_FILE} is not a valid {model_type} config"
        ) from exc


def _build_on_meta(config: Any, is_full: bool) -> _KimiVisionPath:
    """Build tower (+ projector) with no storage: the weights come from the checkpoint.

    Only ``vision_config`` (and ``text_config.hidden_size`` for the projector's output) are
    used; no language-model module is constructed.
    """
    from transformers.models.kimi_k25.modeling_kimi_k25 import (
        Kimi_K25MultimodalProjection,
        Kimi_K25VisionModel,
    )

    with torch.device("meta"):
        if is_full:
            tower = Kimi_K25VisionModel(config.vision_config)
            projector: nn.Module | None = Kimi_K25MultimodalProjection(config)
        else:
            tower = Kimi_K25VisionModel(config)
            projector = None
    return _KimiVisionPath(tower, projector)
