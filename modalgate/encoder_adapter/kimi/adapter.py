"""The local Kimi (MoonViT) encoder adapter: decode, preprocess, encode, in that order, batched.

Decoding runs in the decode pool (many threads: Pillow releases the GIL);
preprocessing and the forward pass run in the batcher's single model thread,
one batch at a time, so the GPU (or the CPU's threads) serve one batch fully.
The cache, decoding, batching and failure isolation are ``towers.local_adapter``'s,
shared with the other local families; this module adds Kimi's preprocessor and tower.
"""

from __future__ import annotations

import os

from PIL import Image

from modalgate.encoder_adapter.batching import BatchSettings
from modalgate.encoder_adapter.towers.local_adapter import LocalImageAdapter, Output
from modalgate.media.decode import DEFAULT_MAX_PIXELS

__all__ = ["KimiEncoderAdapter", "kimi_encoder"]


class KimiEncoderAdapter(LocalImageAdapter):
    name = "kimi"

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
        from modalgate.encoder_adapter.kimi.preprocess import KimiPreprocessor
        from modalgate.encoder_adapter.kimi.tower import TransformersVisionEncoder

        self.model = TransformersVisionEncoder(path, device=device)
        settings = self.model.preprocessor_settings
        self.preprocessor = KimiPreprocessor(**settings)
        self._merge = int(settings.get("merge_size", 2))
        super().__init__(
            settings_key=self.preprocessor.settings_key(),
            batch=batch,
            cache_bytes=cache_bytes,
            decode_workers=decode_workers,
            max_pixels=max_pixels,
        )

    def _patches(self, image: Image.Image) -> int:
        return self.preprocessor.tokens_for(*image.size) * self._merge**2

    def _forward(self, images: list[Image.Image]) -> list[Output | BaseException]:
        pixel_values, grid_thw = self.preprocessor(images)
        embeddings = self.model.encode(pixel_values, grid_thw)
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        return [(e, (g[0], g[1], g[2])) for e, g in zip(embeddings, grids, strict=True)]


def kimi_encoder(arg: str | None) -> KimiEncoderAdapter:
    """Registry factory: ``kimi:DIR`` (a Kimi vision tower or a full Kimi-K2.5-style checkpoint)."""
    if not arg:
        raise ValueError("the kimi encoder needs a checkpoint directory: --encoder kimi:DIR")
    return KimiEncoderAdapter(arg)
