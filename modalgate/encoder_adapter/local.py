"""The local Kimi (MoonViT) encoder adapter: decode, preprocess, encode, in that order, batched.

Decoding runs in the decode pool (many threads: Pillow releases the GIL);
preprocessing and the forward pass run in the batcher's single model thread,
one batch at a time, so the GPU (or the CPU's threads) serve one batch fully.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from PIL import Image

from modalgate.encoder_adapter.batching import BatchSettings, MicroBatcher, Overloaded
from modalgate.encoder_adapter.cache import EmbeddingCache, content_key
from modalgate.encoder_adapter.protocol import Encoded
from modalgate.errors import ErrorCode, Violation
from modalgate.media.decode import DEFAULT_MAX_PIXELS, DecodeError, DecodeOptions, DecodePool

logger = logging.getLogger("modalgate.encoder")
Output = tuple[Any, tuple[int, int, int]]  # (embedding [tokens, hidden], grid_thw)


class KimiEncoderAdapter:
    name = "kimi"
    modalities = frozenset({"image"})

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
        from modalgate.encoder_adapter.kimi import KimiPreprocessor
        from modalgate.encoder_adapter.transformers_encoder import TransformersVisionEncoder

        self.model = TransformersVisionEncoder(path, device=device)
        settings = self.model.preprocessor_settings
        self.preprocessor = KimiPreprocessor(**settings)
        batch = batch or BatchSettings()
        self.max_batch = batch.max_items
        self._merge = int(settings.get("merge_size", 2))
        self._settings_key = self.preprocessor.settings_key()
        self.cache = EmbeddingCache(cache_bytes)
        # The gate has enforced the policy's pixel limit; this one guards direct use.
        self.decoder = DecodePool(decode_workers, DecodeOptions(max_pixels=max_pixels))
        self.batcher: MicroBatcher[Image.Image, Output] = MicroBatcher(
            self._run_batch, batch, cost=self._patches
        )

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        results: list[Encoded | None] = [None] * len(images)
        misses: dict[str, list[int]] = {}  # one encode per distinct image in the request
        for index, data in enumerate(images):
            key = content_key(data, self._settings_key)
            hit = self.cache.get(key)
            if hit is not None:
                results[index] = Encoded(embedding=hit[0], grid_thw=hit[1], cached=True)
            else:
                misses.setdefault(key, []).append(index)
        if misses and self.batcher.queue_depth + len(misses) > self.batcher.settings.max_queue:
            raise Overloaded(self.batcher.retry_after())
        decoded = await self.decoder.decode_many([images[i[0]] for i in misses.values()])
        encoded = await asyncio.gather(
            *(self._encode_one(key, image) for key, image in zip(misses, decoded, strict=True))
        )
        for indices, result in zip(misses.values(), encoded, strict=True):
            for index in indices:
                results[index] = result
        return [r if r is not None else Encoded(error=_failed()) for r in results]

    async def warmup(self) -> None:
        """One forward pass before serving (kernels, allocator): not through the queue, so a
        queue sized for backpressure never refuses it."""
        await asyncio.to_thread(self._forward, [Image.new("RGB", (28, 28))])

    async def close(self) -> None:
        await self.batcher.close()
        self.decoder.close()

    async def _encode_one(self, key: str, image: Image.Image | DecodeError) -> Encoded:
        if isinstance(image, DecodeError):
            return Encoded(error=Violation(ErrorCode.INVALID_IMAGE, str(image)))
        try:
            embedding, grid = await self.batcher.submit(image)
        except Overloaded:
            raise
        except TimeoutError:
            return Encoded(
                error=Violation(ErrorCode.ENCODER_OVERLOADED, "the encoder did not answer in time")
            )
        except Exception:
            logger.exception("the encoder failed on an accepted image")
            return Encoded(error=_failed())
        self.cache.put(key, (embedding, grid), embedding.numel() * embedding.element_size())
        return Encoded(embedding=embedding, grid_thw=grid)

    def _patches(self, image: Image.Image) -> int:
        return self.preprocessor.tokens_for(*image.size) * self._merge**2

    def _run_batch(self, images: list[Image.Image]) -> list[Output | BaseException]:
        """In the model thread. A failing batch is retried one image at a time, so one
        bad image costs its own result only."""
        try:
            return self._forward(images)
        except Exception:
            if len(images) == 1:
                raise
        outputs: list[Output | BaseException] = []
        for image in images:
            try:
                outputs.extend(self._forward([image]))
            except Exception as exc:
                outputs.append(exc)
        return outputs

    def _forward(self, images: list[Image.Image]) -> list[Output | BaseException]:
        pixel_values, grid_thw = self.preprocessor(images)
        embeddings = self.model.encode(pixel_values, grid_thw)
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        return [(e, (g[0], g[1], g[2])) for e, g in zip(embeddings, grids, strict=True)]


def _failed() -> Violation:
    return Violation(ErrorCode.ENCODER_ERROR, "the encoder failed on this image")


def kimi_encoder(arg: str | None) -> KimiEncoderAdapter:
    """Registry factory: ``kimi:DIR`` (a Kimi vision tower or a full Kimi-K2.5-style checkpoint)."""
    if not arg:
        raise ValueError("the kimi encoder needs a checkpoint directory: --encoder kimi:DIR")
    return KimiEncoderAdapter(arg)
