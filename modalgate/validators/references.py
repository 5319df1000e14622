"""A reference to media by id alone (a ``uuid`` part with no payload) judged as what it names.

Such a part carries no bytes: the engine serves it from its cache. The gateway knows
what the tenant sent under that id before (``gateway/gate/id_store.py``), so the part
is judged as that media: its modality must be the one the part claims, it must have been
judged under the same rule and limits, and its tokens count in the request's budget.
Pure: the caller looked the ids up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from modalgate.errors import ErrorCode, Violation
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.media_checks import budget_violations
from modalgate.validators.verdict import MediaPart, Verdict, amended


@dataclass(frozen=True, slots=True)
class CachedMedia:
    """What was judged of media a tenant sent under an id: enough to judge a reference."""

    modality: str
    rule: ResolvedRule
    tokens: int | None = None
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    seconds: float | None = None
    bytes: int | None = None
    format: str | None = None

    @classmethod
    def of(cls, part: MediaPart, rule: ResolvedRule) -> CachedMedia:
        # Token-in tensors are client embeddings standing for the modality in ``format``.
        features = part.part_type == "features" and part.format is not None
        return cls(
            part.format if features and part.format else part.modality,
            rule,
            part.tokens,
            part.width,
            part.height,
            part.frames,
            part.seconds,
            part.bytes,
            part.format,
        )


def check_references(verdict: Verdict, recalled: Mapping[int, CachedMedia | None]) -> Verdict:
    """``verdict`` with each reference (``verdict.parts`` index -> what its id named, None
    where nothing) judged as that media: facts filled, budgets counted again."""
    rule = verdict.rule
    assert rule is not None
    parts = list(verdict.parts)
    violations: list[Violation] = []
    for index, cached in recalled.items():
        part = parts[index]
        problem = _problem(part, cached, rule)
        if problem is not None:
            violations.append(problem)
        elif cached is not None:
            parts[index] = replace(
                part,
                tokens=cached.tokens,
                width=cached.width,
                height=cached.height,
                frames=cached.frames,
                seconds=cached.seconds,
                bytes=cached.bytes,
                format=cached.format,
            )
    if not violations:
        violations = budget_violations(parts, rule)
    return amended(verdict, parts=tuple(parts), violations=(*verdict.violations, *violations))


def _problem(part: MediaPart, cached: CachedMedia | None, rule: ResolvedRule) -> Violation | None:
    where = part.id_param or part.param
    shown = (part.media_id or "")[:60]
    if cached is None:
        return Violation(
            ErrorCode.UNKNOWN_MEDIA_ID,
            f"{where}: no media was sent with id {shown!r} by this caller for this model"
            " through this gateway (or it has been forgotten); send the media with it",
            where,
        )
    if cached.modality != part.modality:
        return Violation(
            ErrorCode.MODALITY_MISMATCH,
            f"{where}: id {shown!r} names {cached.modality} media, sent here as {part.modality}",
            where,
        )
    if cached.rule != rule:
        return Violation(
            ErrorCode.UNKNOWN_MEDIA_ID,
            f"{where}: the media sent with id {shown!r} was judged under other limits (the"
            " policy changed since); send the media with it again",
            where,
        )
    return None
