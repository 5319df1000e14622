"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL encoder adapter: ``--encoder qwen:DIR``.

Per image it produces what the language model consumes in place of the image's placeholder
tokens: the vision tower's output *after* the patch merger, ``[t*h*w/merge², LM hidden]``,
plus ``grid_thw`` (the patch grid before merging, as vLLM's ``image_grid_thw``). That pair is
exactly a vLLM ``image_embeds`` dict part for these models (see docs/embeds.md).

* **Preprocessing** is transformers' own image processor loaded from DIR
  (``AutoImageProcessor``: ``Qwen2VLImageProcessor``, the torchvision backend): the same code
  vLLM runs, so there is no second implementation to drift from it.
* **Encoding** is ``qwen.tower.QwenVisionEncoder``: the tower alone, never the language model.

Cache, decoding, batching and failure isolation are ``towers.local_adapter``'s.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from PIL import Image

from modalgate.encoder_adapter.batching import BatchSettings
from modalgate.encoder_adapter.qwen.tower import QwenVisionEncoder
from modalgate.encoder_adapter.towers.local_adapter import LocalImageAdapter, Output
from modalgate.encoder_adapter.towers.vision_tower import EncoderLoadError
from modalgate.media.decode import DEFAULT_MAX_PIXELS

__all__ = ["QwenEncoderAdapter", "qwen_encoder"]


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
