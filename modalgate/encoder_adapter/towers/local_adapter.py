"""What every local image adapter does around its model: cache, decode, batch, isolate failures.

``LocalImageAdapter`` is the part of an in-process encoder adapter that does not depend on
the model family: a content-hash cache in front, Pillow decoding in a thread pool, a
micro-batcher feeding one model thread, and per-image failure isolation (a failing batch is
retried one image at a time). A family adapter (``kimi.adapter``, ``qwen.adapter``)
adds two things: ``_forward`` (preprocess + encode a batch of decoded images, in the model
thread) and ``_patches`` (the batcher's cost of one image). Keeping one copy of this
pipeline means a fix to caching, backpressure or error mapping reaches every family.

This module imports no torch: the family adapters load it when they are created.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from PIL import Image

from modalgate.encoder_adapter.batching import BatchSettings, MicroBatcher, Overloaded
from modalgate.encoder_adapter.cache import EmbeddingCache, content_key
from modalgate.encoder_adapter.protocol import Encoded
from modalgate.errors import ErrorCode, Violation
from modalgate.media.decode import DEFAULT_MAX_PIXELS, DecodeError, DecodeOptions, DecodePool

__all__ = ["LocalImageAdapter", "Output"]

logger = logging.getLogger("modalgate.encoder")
Output = tuple[Any, tuple[int, int, int]]  # (embedding [tokens, hidden], grid_thw)


class LocalImageAdapter:
    """The shared pipeline; subclasses set ``name`` and implement ``_forward`` and ``_patches``.

    Attributes the gateway and metrics read: ``batcher`` (queue depth, batch counts),
    ``cache`` (hits, bytes), ``decoder``, ``max_batch``.
    """

    name: ClassVar[str] = "local"
    modalities: ClassVar[frozenset[str]] = frozenset({"image"})
    # The warmup image: any size the family's preprocessor takes (28x28 is one merged
    # 14-pixel patch window; processors that need more upscale it).
    warmup_size: ClassVar[tuple[int, int]] = (28, 28)

    def __init__(
        self,
        *,
        settings_key: str,
        batch: BatchSettings | None = None,
        cache_bytes: int = 256 * 1024 * 1024,
        decode_workers: int = 2,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        """``settings_key`` joins the image hash in cache keys: two preprocessings of the same
        bytes are different embeddings."""
        batch = batch or BatchSettings()
        self.max_batch = batch.max_items
        self._settings_key = settings_key
        self.cache = EmbeddingCache(cache_bytes)
        # The gate has enforced the policy's pixel limit; this one guards direct use.
        self.decoder = DecodePool(decode_workers, DecodeOptions(max_pixels=max_pixels))
        self.batcher: MicroBatcher[Image.Image, Output] = MicroBatcher(
            self._run_batch, batch, cost=self._patches
        )

    # ------------------------------------------------------------------ family hooks

    def _forward(self, images: list[Image.Image]) -> list[Output | BaseException]:
        """Preprocess and encode a batch (model thread): one ``(embedding, grid)`` per image."""
        raise NotImplementedError

    def _patches(self, image: Image.Image) -> int:
        """The batcher's cost of one image: the patches its forward pass will process."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the protocol

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
        await asyncio.to_thread(self._forward, [Image.new("RGB", self.warmup_size)])

    async def close(self) -> None:
        await self.batcher.close()
        self.decoder.close()

    # ------------------------------------------------------------------ internals

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


def _failed() -> Violation:
    return Violation(ErrorCode.ENCODER_ERROR, "the encoder failed on this image")
