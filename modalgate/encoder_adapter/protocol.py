"""The encoder adapter protocol, in the manner of httpx's transports: a small class, few jobs.

An adapter takes the validated images of one request (raw bytes: decoding is
the adapter's job, so a cache hit skips it) and returns one result per image:
an embedding, or the violation that stopped that image. One bad image never
fails the others. ``Overloaded`` (from ``batching``) is the one exception that
concerns the whole request: the gateway answers it with 503 and Retry-After.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from modalgate.errors import Violation


@dataclass(frozen=True, slots=True)
class Encoded:
    """One image's result: an embedding ``[tokens, hidden]`` or an error, never both."""

    embedding: Any | None = None  # torch.Tensor, float32, on the CPU
    grid_thw: tuple[int, int, int] | None = None
    error: Violation | None = None
    cached: bool = False


@runtime_checkable
class EncoderAdapter(Protocol):
    name: str
    modalities: frozenset[str]  # what it encodes, e.g. {"image"}
    max_batch: int

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]: ...

    async def warmup(self) -> None: ...

    async def close(self) -> None: ...
