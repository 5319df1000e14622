"""An LRU cache of embeddings, bounded in bytes.

The key is a content hash of the image bytes plus the preprocessing settings,
so the same picture sent twice (a common case: a chat's history resends its
images every turn) skips decoding, preprocessing and the model.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any


def content_key(data: bytes, settings_key: str) -> str:
    return hashlib.blake2b(data, digest_size=20, person=b"modalgate-img").hexdigest() + settings_key


class EmbeddingCache:
    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: Any, size: int) -> None:
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
