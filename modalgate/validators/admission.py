"""The one decision every media part meets, whichever API carried it: modality, then role."""

from __future__ import annotations

from modalgate.errors import ErrorCode, Violation
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.verdict import PartDraft, VerdictBuilder

# Media of one modality kept past its count limit before the walk stops: the request is
# refused for the count whatever follows, and each part read costs ~10 us (80,000 image
# strings in a 244 KiB /generate body took 0.9 s to read, keep and count).
COUNT_MARGIN = 64


class CountExceeded(Exception):
    """``admit`` kept ``COUNT_MARGIN`` more media of a modality than its limit: the walk
    ends (``validators.request`` catches it) and the count refuses the request."""


def admit(part: PartDraft, rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """Keep a media part for the content checks, or refuse it for its modality or role."""
    if part.modality not in rule.accepts:
        verdict.unsupported.add(part.modality)
        verdict.violations.append(unsupported(part, rule, verdict))
    elif part.role not in rule.media_roles:
        allowed = ", ".join(sorted(rule.media_roles))
        verdict.violations.append(
            Violation(
                ErrorCode.ROLE_NOT_ALLOWED,
                f"{part.param}: {part.modality} input is not allowed in '{part.role[:40]}' "
                f"messages (allowed in: {allowed})",
                part.param,
            )
        )
    else:
        verdict.parts.append(part)
        limit = rule.limits.max_count(part.modality)
        if limit is not None:
            counts = verdict.counts
            if counts is None:
                counts = verdict.counts = {}
            kept = counts[part.modality] = counts.get(part.modality, 0) + 1
            if kept > limit + COUNT_MARGIN:
                raise CountExceeded


def unsupported(part: PartDraft, rule: ResolvedRule, verdict: VerdictBuilder) -> Violation:
    param = part.type_param or part.param
    if rule.message:
        message = f"{param}: {rule.message} (got {part.modality} input)"
    else:
        mode = f" in {verdict.mode} mode" if verdict.mode else ""
        accepts = ", ".join(sorted(rule.accepts)) or "text only"
        name = (verdict.judged_as or verdict.model or "")[:100]
        message = (
            f"{param}: {part.modality} input is not supported by {name}{mode} (accepts: {accepts})"
        )
    return Violation(ErrorCode.UNSUPPORTED_MODALITY, message, param)


def invalid(message: str, param: str) -> Violation:
    return Violation(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param)
