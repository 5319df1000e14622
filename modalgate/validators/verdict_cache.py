"""What the content checks learned about media already judged, recalled by their exact bytes.

A chat client resends the whole conversation every turn, images included: turn ten of a
chat with four photos carries the same four payloads it carried at turn one. The content
checks (base64 decode, the format's structure walk, the token estimate) give the same
answer for the same bytes under the same limits, so an accepted part's facts are kept
and a later part with the very same payload takes them instead of being walked again.

Identity is the payload itself, not a digest of it: an entry keeps the base64 text it
was judged on, and a part takes the entry's facts only where its text is byte for byte
that text (one ``memcmp``, ~0.05 ms a megabyte, against ~0.4 ms for a BLAKE3 of it). No
bytes, crafted or not, can share an entry they are not. The lookup key is the rule's
limits, what the part claims to be, the text's length and three short windows of it;
two texts alike there but different elsewhere only take turns in one slot.

Only the work is skipped, never the judgement: the limits and token spec that judged an
entry are part of its key, so the same bytes under other limits are judged afresh (a
policy reload that changes a rule's limits misses; one that does not, hits). Refusals
are not kept (their wording names the part's place in its request). Bounded by entries
and by bytes (the texts, plus ``ENTRY_OVERHEAD_BYTES`` each); least recently used go
first. Pure memory, no I/O: it may be shared by every gate of a process and is safe
across the worker threads validation runs in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from modalgate.policy.matching import ResolvedRule
from modalgate.validators.verdict import PartDraft

# Accounted per entry beside its text: the entry and its facts, the key tuple (three
# 32-byte windows), the OrderedDict slot, the text's place in the index ``known_run``
# reads (tests/validators/test_verdict_cache.py measures ~1,100 with tracemalloc).
ENTRY_OVERHEAD_BYTES = 1200
WINDOW = 32  # bytes of the text at its start, middle and end in the lookup key
# Where a body's run is recognised (``known_run``): past the header bytes most photos of
# one format share, inside the payload's own data (``min_payload_bytes`` is at least this).
PROBE_AT = 2048


@dataclass(frozen=True, slots=True)
class ContentFacts:
    """What ``media_checks.content_violations`` set on an accepted part."""

    format: str | None
    width: int | None
    height: int | None
    frames: int | None
    seconds: float | None
    bytes: int | None
    tokens: int | None

    @classmethod
    def of(cls, part: PartDraft) -> ContentFacts:
        return cls(
            part.format, part.width, part.height, part.frames, part.seconds, part.bytes, part.tokens
        )

    def apply(self, part: PartDraft) -> None:
        part.format, part.width, part.height = self.format, self.width, self.height
        part.frames, part.seconds, part.bytes, part.tokens = (
            self.frames,
            self.seconds,
            self.bytes,
            self.tokens,
        )


@dataclass(slots=True)
class _Entry:
    text: bytes
    facts: ContentFacts
    digest: bytes | None  # BLAKE3 of the decoded bytes, once a media id needed it


class VerdictCache:
    """Accepted parts' content facts by their exact payload (module docstring)."""

    def __init__(
        self,
        max_entries: int = 10_000,
        max_bytes: int = 128 * 1024 * 1024,
        min_payload_bytes: int = 4096,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_payload_bytes = max(min_payload_bytes, PROBE_AT + WINDOW)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        # The texts held, by their window at PROBE_AT: [text, entries holding it] each
        self._texts: dict[bytes, list[list[Any]]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        # Told of each lookup (True: a hit), for metrics; called in validation's thread.
        self.on_lookup: Callable[[bool], None] | None = None

    def resize(self, max_entries: int, max_bytes: int, min_payload_bytes: int) -> None:
        """New bounds (a policy reload); what no longer fits goes, oldest first."""
        with self._lock:
            self.max_entries, self.max_bytes = max_entries, max_bytes
            self.min_payload_bytes = max(min_payload_bytes, PROBE_AT + WINDOW)
            self._evict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def accounted_bytes(self) -> int:
        return self._bytes

    def takes(self, payload: str | memoryview | bytes) -> bool:
        """Whether a payload this long is worth a lookup (small ones are cheaper to walk)."""
        return self.max_entries > 0 and len(payload) >= self.min_payload_bytes

    def known_run(self, body: bytes, begin: int) -> bytes | None:
        """The text held here that ``body`` has from ``begin`` up to a closing quote, if
        one is: found by one comparison in place of the scan for that quote
        (``json_body.payloads_aside``), and handed on as the very object held, so the
        lookup that follows (``recall``) compares nothing again."""
        window = body[begin + PROBE_AT : begin + PROBE_AT + WINDOW]
        with self._lock:
            held = [text for text, _ in self._texts.get(window, ())]
        for text in held:
            end = begin + len(text)
            if body[end : end + 1] == b'"' and body.startswith(text, begin):
                return text
        return None

    def recall(self, key: Hashable, text: bytes | memoryview) -> _Entry | None:
        """The entry judged on exactly ``text`` under ``key`` (``key_of``); None: judge it."""
        with self._lock:
            entry = self._entries.get(key)
            # Equal lengths (the key's), so a prefix is the whole: one memcmp, no copy;
            # none where the body's run was recognised as this very text.
            found = entry is not None and (entry.text is text or entry.text.startswith(text))
            if found:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if self.on_lookup is not None:
            self.on_lookup(found)
        return entry if found else None

    def remember(self, key: Hashable, text: bytes | memoryview, part: PartDraft) -> None:
        """Keep an accepted part's facts, and its digest where one was taken, under the
        key its lookup had (the part as it was before it was judged)."""
        size = len(text) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        held = text if type(text) is bytes else bytes(text)
        entry = _Entry(held, ContentFacts.of(part), part.digest)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(old)
            self._entries[key] = entry
            self._bytes += size
            texts = self._texts.setdefault(held[PROBE_AT : PROBE_AT + WINDOW], [])
            for same in texts:
                if same[0] is held:
                    same[1] += 1
                    break
            else:
                texts.append([held, 1])
            self._evict()

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            _, old = self._entries.popitem(last=False)
            self._forget(old)

    def _forget(self, entry: _Entry) -> None:
        self._bytes -= len(entry.text) + ENTRY_OVERHEAD_BYTES
        window = entry.text[PROBE_AT : PROBE_AT + WINDOW]
        texts = self._texts[window]
        for at, same in enumerate(texts):
            if same[0] is entry.text:
                same[1] -= 1
                if not same[1]:
                    del texts[at]
                break
        if not texts:
            del self._texts[window]


def key_of(text: bytes | memoryview, part: PartDraft, rule: ResolvedRule) -> Hashable:
    """What judged it (limits, token spec), what the part claims (its modality, type, MIME
    and format before the bytes are read), and where to look: the text's length and three
    windows of it. Equal keys still need equal texts (``recall``)."""
    middle = len(text) // 2
    return (
        rule.limits,
        rule.tokens,
        part.modality,
        part.part_type,
        part.mime,
        part.format,
        len(text),
        bytes(text[:WINDOW]),
        bytes(text[middle : middle + WINDOW]),
        bytes(text[-WINDOW:]),
    )
