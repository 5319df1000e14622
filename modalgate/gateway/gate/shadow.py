"""Shadow mode: what it may let through, and the checks a shadowed request still meets.

With ``enforce: false`` (the policy, one rule, or ``--no-enforce``) a request the
policy refuses is forwarded anyway, and the refusal it would have had is logged,
counted and named in a response header: a safe first step when putting the gate
in front of live traffic.

Shadow mode covers the gate's *judgement* of what it could read: the model's
capabilities and limits, and the content checks on the media parts. It never
covers reading or fetching, because forwarding what the gate could not read or
refused to fetch would hand the upstream exactly what the gate exists to stop:
a body that does not parse (or parses differently in the server: duplicate
keys), a part type or shape the gate does not know (it may carry a URL no check
saw), a body over the size cap, and any URL refused or not fetchable (SSRF: a
shadowed request must never make the model server download what the gate would
not). Headers, methods, 413s and authentication are refused before any verdict
and are not shadowed either.

A refused verdict does not describe the whole request (validation stops at the
first failing stage), so the request is read once more under a lenient copy of
the policy, in which every rule takes every modality in every role and counts
are unlimited: every part is then walked and every URL checked and fetched
(and inlined) exactly as an accepted request's would be.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import get_args

from modalgate.errors import ErrorCode, Violation
from modalgate.policy import Policy, ResolvedRule, RuleMatcher
from modalgate.policy.models import Limits, MediaModality, Role
from modalgate.validators import Verdict

SHADOW_HEADER = b"x-modalgate-shadow"
# The refusals shadow mode may turn into a forward (every other code is always enforced;
# a code added later is enforced until it is listed here).
SHADOWABLE = frozenset(
    {
        ErrorCode.UNKNOWN_MODEL,
        ErrorCode.UNSUPPORTED_MODALITY,
        ErrorCode.ROLE_NOT_ALLOWED,
        ErrorCode.TOO_MANY_MEDIA,
        ErrorCode.MODALITY_MISMATCH,
        ErrorCode.INVALID_BASE64,
        ErrorCode.INVALID_IMAGE,
        ErrorCode.UNSUPPORTED_IMAGE_FORMAT,
        ErrorCode.ANIMATED_IMAGE,
        ErrorCode.IMAGE_TOO_LARGE,
        ErrorCode.IMAGE_TOO_SMALL,
        ErrorCode.UNSUPPORTED_IMAGE_SHAPE,
        ErrorCode.TOO_MANY_IMAGE_TOKENS,
        ErrorCode.INVALID_MEDIA,
        ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
        ErrorCode.MEDIA_TOO_LARGE,
        ErrorCode.MEDIA_TOO_SMALL,
    }
)
MAX_HEADER_VIOLATIONS = 8
_UNLIMITED_COUNTS = dict.fromkeys(
    ("max_images", "max_videos", "max_audios", "max_files", "max_embeddings")
)
_HEADER_UNSAFE = re.compile(r"[^A-Za-z0-9_.\[\]-]")


def in_shadow_mode(rule: ResolvedRule | None, enforce: bool | None) -> bool:
    """Whether refusals under ``rule`` are shadowed: ``enforce`` None: as the policy says;
    False: every rule's are; True: none are. Never under a rule with ``embeds``: the
    gateway itself encodes its images, and cannot encode what it refused."""
    if enforce or rule is None or rule.embeds is not None:
        return False
    return enforce is False or not rule.enforce


def shadow_in_effect(matcher: RuleMatcher, enforce: bool | None) -> str | None:
    """Which refusals shadow mode forwards, in words for the start-up line; None: none."""
    if enforce:
        return None
    if enforce is False:
        embeds = [rule.name for rule in matcher.rules if rule.embeds is not None]
        return "every rule but embeds rules: " + ", ".join(embeds) if embeds else "every rule"
    policy = matcher.policy
    names = [
        rule.name
        for rule in matcher.rules
        if rule.embeds is None and not (policy.enforce if rule.enforce is None else rule.enforce)
    ]
    if not policy.enforce:
        names.append("unknown models")
    return ", ".join(names) or None


def may_shadow(verdict: Verdict, enforce: bool | None) -> bool:
    """Whether this refusal is shadowed: its rule is in shadow mode, and shadow mode
    covers every one of its violations."""
    return (
        bool(verdict.violations)
        and in_shadow_mode(verdict.rule, enforce)
        and all(v.code in SHADOWABLE for v in verdict.violations)
    )


def enforced(violations: Sequence[Violation]) -> list[Violation]:
    """The violations shadow mode never lets through."""
    return [v for v in violations if v.code not in SHADOWABLE]


@lru_cache(maxsize=8)
def lenient_matcher(matcher: RuleMatcher) -> RuleMatcher:
    """``matcher``'s policy with capabilities and counts opened up, everything else kept:
    validated under it, a request's every part is walked and every URL checked."""
    return RuleMatcher(lenient_policy(matcher.policy), matcher.mode)


def lenient_policy(policy: Policy) -> Policy:
    every_modality = get_args(MediaModality)
    rules = tuple(
        rule.model_copy(
            update={
                "accepts": every_modality,
                "media_roles": None,
                "fallback": None,
                "limits": _uncounted(rule.limits) if rule.limits is not None else None,
            }
        )
        for rule in policy.models
    )
    return policy.model_copy(
        update={
            "unknown_models": "allow",
            "media_roles": get_args(Role),
            "limits": _uncounted(policy.limits),
            "models": rules,
        }
    )


def _uncounted(limits: Limits) -> Limits:
    return limits.model_copy(update=_UNLIMITED_COUNTS)


def shadow_header(violations: Sequence[Violation]) -> bytes:
    """``unsupported_modality; param=messages.[0].content.[1].type``, comma-separated."""
    entries = []
    for violation in violations[:MAX_HEADER_VIOLATIONS]:
        entry = violation.code.value
        if violation.param:
            entry += "; param=" + _HEADER_UNSAFE.sub("_", violation.param[:200])
        entries.append(entry)
    return ", ".join(entries).encode("ascii")
