"""What validation hands to the next stage: the parsed request, its media parts, the rule.

A ``Verdict`` and its ``MediaPart``s are frozen once made, so a stage that learns
more (fetched bytes, a fallback) returns a new verdict and every holder of the old
one (the request's state, logs, metrics) keeps seeing what it saw. Validation
fills the mutable ``VerdictBuilder`` and ``PartDraft`` and freezes them once.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import pybase64

from modalgate.errors import Violation, status_of
from modalgate.media.data_url import decode_base64
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.json_body import (
    Default,
    Location,
    Unset,
    location_of,
    parse_json_body,
)

_INLINE = frozenset({"data", "base64"})  # sources whose payload is base64 text


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One media content part with where it sits and what probing learned about it.

    ``data`` holds the decoded bytes of a data URL or inline base64 payload, so
    nothing downstream (encoder, proxy rewrite) decodes the same base64 again.
    """

    param: str  # the part itself: messages.[0].content.[1]
    part_type: str
    modality: str
    role: str
    # data | url | base64 | file_id | embeds | cached (a uuid, no payload) | upload (multipart)
    source: str
    url: str | None = None  # remote URL, never a data URL
    mime: str | None = None
    format: str | None = None
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    seconds: float | None = None  # video and audio: the span of the packets counted
    bytes: int | None = None
    tokens: int | None = None  # estimated vision tokens, where the rule's family has an estimator
    payload_param: str | None = None  # where the URL or base64 sits
    type_param: str | None = None  # where the declared type sits
    data: bytes | None = field(default=None, repr=False)
    # The URL sits where a data URL may stand instead, so fetched bytes can be inlined.
    inlinable: bool = False
    # The base64 text (or the body's bytes of it: ``json_body.payloads_aside``), until decoded.
    payload: str | memoryview | bytes | None = field(default=None, repr=False)
    # The client's id for the media (vLLM's ``uuid``), and where it sits: the engine's
    # caches key on it, so the gate rewrites it (``gateway/gate/media_ids.py``).
    media_id: str | None = None
    id_param: str | None = None
    # BLAKE3 of ``data``, taken where the bytes were checked, for a part with an id.
    digest: bytes | None = field(default=None, repr=False)

    @property
    def payload_at(self) -> str:
        """The one param that locates this part's payload: what a violation on it names."""
        return self.payload_param or self.param

    @property
    def has_content(self) -> bool:
        """Whether ``content()`` has bytes to give (not a file id, nor an unfetched URL)."""
        return self.data is not None or (self.payload is not None and self.source in _INLINE)

    def content(self) -> bytes | None:
        """The decoded bytes, for a stage that needs them (an encoder): a payload judged
        before (``verdict_cache.py``) was not decoded again, so it is decoded here."""
        if self.data is not None or not self.has_content:
            return self.data
        assert self.payload is not None
        return decode_base64(self.payload)

    def draft(self) -> PartDraft:
        """A mutable copy, for a stage that checks the part again (fetched bytes)."""
        return PartDraft(*(getattr(self, name) for name in _PART_FIELDS))

    def inlined(self) -> list[tuple[Location, Any]]:
        """The edits that forward the fetched bytes, as a data URL, instead of the URL: in
        its place, or for an ``input_file``'s ``file_url`` (a slot for URLs only) as its
        ``file_data``, with a ``filename`` where it has none (OpenAI asks for one)."""
        if not self.inlinable or self.data is None or self.url is None:
            return []
        if self.format and self.modality in ("image", "video", "audio"):
            mime = f"{self.modality}/{self.format}"  # what the bytes are, not what a server said
        else:
            mime = self.mime or "application/octet-stream"
        data_url = f"data:{mime};base64,{pybase64.b64encode(self.data).decode()}"
        where = location_of(self.payload_at)
        if where[-1] != "file_url":
            return [(where, data_url)]
        name = posixpath.basename(urlsplit(self.url).path)[:100] or "file"
        part = where[:-1]
        return [
            (where, Unset),
            ((*part, "file_data"), data_url),
            ((*part, "filename"), Default(name)),
        ]

    def inlined_size(self) -> int:
        """Bytes the body grows by once this part's data URL replaces its URL (at most)."""
        if not self.inlinable or self.data is None or self.url is None:
            return 0
        return 160 + (len(self.data) + 2) // 3 * 4 - len(self.url)

    def facts(self) -> dict[str, Any]:
        return {
            "param": self.param,
            "type": self.part_type,
            "modality": self.modality,
            "source": self.source,
            "url": self.url,
            "mime": self.mime,
            "format": self.format,
            "width": self.width,
            "height": self.height,
            "frames": self.frames,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "tokens": self.tokens,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """Accepted (no violations) or refused (every violation the checks found)."""

    violations: tuple[Violation, ...]
    parts: tuple[MediaPart, ...] = ()
    model: str | None = None  # as the client sent it
    mode: str | None = None
    rule: ResolvedRule | None = None
    request: dict[str, Any] | None = field(default=None, repr=False)
    # Media the rule does not accept, by modality: what a fallback route may take instead.
    unsupported: frozenset[str] = frozenset()
    # Set when a fallback sent this request to another model: the rule of the model the
    # client asked for (a policy name, safe for metric labels; ``model`` is the new one).
    routed_from: str | None = None
    api: str = "chat"  # which request shape was read (validators.request.Api)
    # The model the request was judged as, when not the one it named: the policy's
    # default_model, or the model its upstream really serves.
    judged_as: str | None = None
    body_bytes: int = 0  # the body as received, where validation was given its size
    # Where the body names media by a hash an engine trusts without a tenant (SGLang's
    # ``content_hash``, ``mm_content_hashes``, ``mm_hashes``): dropped unless ids pass.
    hash_params: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        return not self.violations

    @property
    def remote_parts(self) -> list[MediaPart]:
        return [part for part in self.parts if part.url is not None]

    def with_violations(self, *violations: Violation) -> Verdict:
        """This verdict refused for ``violations`` too (a later stage's findings); a request
        not parsed yet stays unparsed."""
        return amended(self, violations=(*self.violations, *violations))

    @property
    def status(self) -> int:
        return status_of(self.violations) if self.violations else 200

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": "modalgate.verdict",
            "accepted": self.accepted,
            "model": self.model,
            "judged_as": self.judged_as,
            "mode": self.mode,
            "rule": self.rule.name if self.rule and self.rule.known else None,
            "routed_from": self.routed_from,
            "media": [part.facts() for part in self.parts],
            "violations": [v.as_dict() for v in self.violations],
        }


@dataclass(slots=True)
class PartDraft:
    """A ``MediaPart`` while validation still learns about it; ``frozen()`` hands it out.

    The fields are ``MediaPart``'s, in its order (a test holds them equal).
    """

    param: str
    part_type: str
    modality: str
    role: str
    source: str
    url: str | None = None
    mime: str | None = None
    format: str | None = None
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    seconds: float | None = None
    bytes: int | None = None
    tokens: int | None = None
    payload_param: str | None = None
    type_param: str | None = None
    data: bytes | None = field(default=None, repr=False)
    inlinable: bool = False
    payload: str | memoryview | bytes | None = field(default=None, repr=False)
    media_id: str | None = None
    id_param: str | None = None
    digest: bytes | None = field(default=None, repr=False)

    @property
    def payload_at(self) -> str:
        return self.payload_param or self.param

    def frozen(self) -> MediaPart:
        part = _OpenMediaPart()
        for name in _PART_FIELDS:
            setattr(part, name, getattr(self, name))
        part.__class__ = MediaPart
        return part


_PART_FIELDS = tuple(f.name for f in fields(MediaPart))


def _open_twin(frozen: type[Any]) -> type[Any]:
    """``frozen``'s layout with plain attribute assignment, to fill a new instance at
    plain speed before it becomes ``frozen`` (same slots, so ``__class__`` may change).

    CPython 3.11's frozen dataclass ``__init__`` sets each field through
    ``object.__setattr__``, about 1,200 instructions a field (callgrind): a Verdict
    made that way costs 40% more than validating a small chat body did before.
    """
    # Both, or CPython keeps calling the frozen __delattr__'s slot for assignments too.
    # ``object.__init__``: ``twin()`` makes a blank instance for ~30% less than
    # ``object.__new__(twin)`` (whose wrapper checks its caller's type).
    namespace = {
        "__slots__": (),
        "__setattr__": object.__setattr__,
        "__delattr__": object.__delattr__,
        "__init__": object.__init__,
    }
    return type(f"_Open{frozen.__name__}", (frozen,), namespace)


_OpenMediaPart = _open_twin(MediaPart)
_OpenVerdict = _open_twin(Verdict)


@dataclass(slots=True)
class VerdictBuilder:
    """What validation fills in place while it walks one request; ``build()`` freezes it."""

    mode: str | None
    model: str | None = None
    request: dict[str, Any] | None = field(default=None, repr=False)
    api: str = "chat"
    body_bytes: int = 0
    rule: ResolvedRule | None = None
    judged_as: str | None = None
    violations: list[Violation] = field(init=False, default_factory=list)
    parts: list[PartDraft] = field(init=False, default_factory=list)
    unsupported: set[str] = field(init=False, default_factory=set)
    # Media kept, by modality, where the rule limits their count (``admission.admit``).
    counts: dict[str, int] | None = field(init=False, default=None)
    hash_params: list[str] | None = field(init=False, default=None)  # Verdict.hash_params

    def names_by_hash(self, param: str) -> None:
        if self.hash_params is None:
            self.hash_params = []
        self.hash_params.append(param)

    def build(self) -> Verdict:
        verdict = _OpenVerdict()
        verdict.violations = tuple(self.violations) if self.violations else ()
        verdict.parts = tuple(part.frozen() for part in self.parts) if self.parts else ()
        verdict.model = self.model
        verdict.mode = self.mode
        verdict.rule = self.rule
        verdict.request = self.request
        verdict.unsupported = frozenset(self.unsupported) if self.unsupported else _NONE
        verdict.routed_from = None
        verdict.api = self.api
        verdict.judged_as = self.judged_as
        verdict.body_bytes = self.body_bytes
        verdict.hash_params = tuple(self.hash_params) if self.hash_params else ()
        verdict.__class__ = Verdict
        return verdict


_NONE: frozenset[str] = frozenset()


_request_slot: Any = Verdict.__dict__["request"]  # the slot dataclass(slots=True) made


class _UnparsedVerdict(Verdict):
    """A Verdict whose ``request`` slot holds the body it was judged on, read with its long
    payloads aside (``json_body.payloads_aside``): parsed on first read, after which the
    object is a plain Verdict. A proxy that forwards the bytes never pays for a tree of
    them. A subclass, so that the plain Verdict's ``request`` stays a slot (a property
    there cost every text-only verdict ~600 instructions for its one write: P9's gate
    40,811 against 40,192)."""

    __slots__ = ()

    @property  # type: ignore[override]
    def request(self) -> dict[str, Any] | None:
        request = _request_slot.__get__(self, Verdict)
        if type(request) is bytes:  # a copy made before the first read holds the tree
            # The body was read before, its payloads aside, and accepted: it parses.
            request = parse_json_body(request)
            _request_slot.__set__(self, request)
        object.__setattr__(self, "__class__", Verdict)
        return request  # type: ignore[no-any-return]

    @request.setter
    def request(self, value: dict[str, Any] | None) -> None:  # the dataclass __init__'s write
        _request_slot.__set__(self, value)

    def __eq__(self, other: object) -> bool:
        # The dataclass's __eq__ wants one class on both sides: plain verdicts, once parsed.
        if not isinstance(other, Verdict):
            return NotImplemented
        _ = self.request, other.request
        return self == other


def amended(verdict: Verdict, **changes: Any) -> Verdict:
    """``dataclasses.replace`` for a verdict, keeping a request not parsed yet unparsed
    (``replace`` reads every field, and so would parse the whole body)."""
    copy = _OpenVerdict()
    for name in _VERDICT_FIELDS:
        if name in changes:
            value = changes[name]
        elif name == "request":
            value = _request_slot.__get__(verdict, Verdict)
        else:
            value = getattr(verdict, name)
        setattr(copy, name, value)
    copy.__class__ = type(verdict) if "request" not in changes else Verdict
    return copy


_VERDICT_FIELDS = tuple(f.name for f in fields(Verdict))


def request_unparsed(verdict: Verdict) -> bool:
    """Whether reading ``verdict.request`` will parse the body first (a big body's worth)."""
    return type(verdict) is _UnparsedVerdict


def with_unparsed_request(verdict: Verdict, body: bytes) -> Verdict:
    """``verdict`` (just built, not handed out yet), its ``request`` left to be parsed from
    ``body`` when first read."""
    _request_slot.__set__(verdict, body)
    object.__setattr__(verdict, "__class__", _UnparsedVerdict)
    return verdict


def accepted(
    mode: str | None,
    model: str | None,
    rule: ResolvedRule,
    request: dict[str, Any],
    api: str,
    judged_as: str | None,
    body_bytes: int,
) -> Verdict:
    """The verdict on a text-only request: ``VerdictBuilder(...).build()`` without the
    builder (its three containers cost more than the verdict)."""
    verdict = _OpenVerdict()
    verdict.violations = ()
    verdict.parts = ()
    verdict.model = model
    verdict.mode = mode
    verdict.rule = rule
    verdict.request = request
    verdict.unsupported = _NONE
    verdict.routed_from = None
    verdict.api = api
    verdict.judged_as = judged_as
    verdict.body_bytes = body_bytes
    verdict.hash_params = ()
    verdict.__class__ = Verdict
    return verdict


def refused(violation: Violation, mode: str | None) -> Verdict:
    """The verdict on a body validation could not even read."""
    return Verdict((violation,), mode=mode)
