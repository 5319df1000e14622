"""The encoder adapter protocol, in the manner of httpx's transports: a small class, two jobs.

This is the contract the gateway will call once the encoder stage lands (its
own issue); no adapter is implemented or wired in yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from modalgate.errors import Violation


@dataclass(frozen=True, slots=True)
class Encoded:
    """One image's result: embeddings, or the violation that stopped it (never both)."""

    embeddings: Any | None = None
    error: Violation | None = None


@runtime_checkable
class EncoderAdapter(Protocol):
    modalities: frozenset[str]
    max_batch: int

    async def encode(self, images: Sequence[Any]) -> list[Encoded]: ...

    async def warmup(self) -> None: ...

    async def close(self) -> None: ...
