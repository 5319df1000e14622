"""What the gateway remembers of the media ids it bound: enough to resolve a tenant's later
reference by id alone (a part with a ``uuid`` and no payload), and nothing more.

One entry per (tenant, model rule, client id): the key the engine got for it, the rule
that judged the bytes, and the facts the budgets count (modality, tokens, size). Never
the bytes. Bounded three ways (entries, bytes, age since last use) and least-recently
used first out,
so a client minting ids cannot grow it; a forgotten entry only costs the tenant a resend
(its reference is refused with ``unknown_media_id``).

The store is an interface (``MediaIdStore``) so that several gateway replicas can share
one map in a store they already run; the in-process ``MemoryIdStore`` is the default,
one per process (docs/security.md says what that means for replicas and workers).
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import blake3

from modalgate.validators.references import CachedMedia


@dataclass(frozen=True, slots=True)
class Remembered:
    """A fill the engine got: its key, and what a later reference to it is judged as."""

    key: str  # the id the engine got
    media: CachedMedia


class MediaIdStore(Protocol):
    """A map from (tenant, rule, client id) to what was remembered; async, so a shared
    store over the network fits behind it."""

    async def recall(self, tenant: bytes, rule: str, ids: Sequence[str]) -> list[Remembered | None]:
        """What was remembered for each id, in order; None where nothing (or it expired)."""
        ...

    async def remember(
        self, tenant: bytes, rule: str, fills: Sequence[tuple[str, Remembered]]
    ) -> None: ...


# An entry's own cost beyond its strings: the slot (the OrderedDict's node and hash table
# share), the 16-byte key, the Remembered and its floats (tests/gateway/test_media_ids.py
# measures it with tracemalloc and holds this estimate above what it finds).
ENTRY_OVERHEAD_BYTES = 480


class MemoryIdStore:
    """The in-process store: an LRU bounded by entries, accounted bytes and age."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        max_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries, self.max_bytes, self.max_seconds = max_entries, max_bytes, max_seconds
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, Remembered, int]] = OrderedDict()
        self.bytes = 0
        self.evicted = 0  # entries forgotten for room or age, since start

    def __len__(self) -> int:
        return len(self._entries)

    async def recall(self, tenant: bytes, rule: str, ids: Sequence[str]) -> list[Remembered | None]:
        now = self._clock()
        found: list[Remembered | None] = []
        for media_id in ids:
            slot = _slot(tenant, rule, media_id)
            entry = self._entries.get(slot)
            if entry is None:
                found.append(None)
            elif now - entry[0] > self.max_seconds:
                self._drop(slot)
                found.append(None)
            else:  # a use renews it: the order is then by last use, oldest first
                self._entries[slot] = (now, entry[1], entry[2])
                self._entries.move_to_end(slot)
                found.append(entry[1])
        return found

    async def remember(
        self, tenant: bytes, rule: str, fills: Sequence[tuple[str, Remembered]]
    ) -> None:
        now = self._clock()
        for media_id, remembered in fills:
            slot = _slot(tenant, rule, media_id)
            if slot in self._entries:
                self._drop(slot)
            size = entry_bytes(remembered)
            if size > self.max_bytes or not self.max_entries:
                continue
            self._entries[slot] = (now, remembered, size)
            self.bytes += size
        self._trim(now)

    def _trim(self, now: float) -> None:
        entries = self._entries
        while entries and (
            len(entries) > self.max_entries
            or self.bytes > self.max_bytes
            or now - next(iter(entries.values()))[0] > self.max_seconds
        ):
            self._drop(next(iter(entries)))

    def _drop(self, slot: bytes) -> None:
        _, _, size = self._entries.pop(slot)
        self.bytes -= size
        self.evicted += 1


def entry_bytes(remembered: Remembered) -> int:
    """What one entry holds, accounted: its fixed cost and its key string."""
    return ENTRY_OVERHEAD_BYTES + sys.getsizeof(remembered.key)


def _slot(tenant: bytes, rule: str, media_id: str) -> bytes:
    """A fixed-size map key: a client's id may be long, and only its digest is kept."""
    hasher = blake3.blake3()
    for field in (tenant, rule.encode(), media_id.encode("utf-8", "surrogatepass")):
        hasher.update(len(field).to_bytes(4, "little"))
        hasher.update(field)
    return hasher.digest(16)
