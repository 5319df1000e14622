"""Modality-aware fallback: where a refused request may go instead, if its rule opts in.

Pure, like the rest of validation: the gate asks, and forwards to the answer.
One hop only (a fallback's own fallbacks are not followed, so routes never
loop) and within one matcher, so within the gateway's mode.
"""

from __future__ import annotations

from dataclasses import replace

from modalgate.errors import ErrorCode
from modalgate.policy.matching import RuleMatcher
from modalgate.validators.request import DialectOf, validate_request
from modalgate.validators.verdict import Verdict


def fallback_target(verdict: Verdict) -> str | None:
    """The model named by the rule's fallback for every modality it refused, if there is
    one and the refusal was about modality alone; otherwise None (refuse as usual)."""
    rule = verdict.rule
    if verdict.accepted or rule is None or not rule.fallback or not verdict.unsupported:
        return None
    if any(v.code is not ErrorCode.UNSUPPORTED_MODALITY for v in verdict.violations):
        return None
    targets = {rule.fallback_for(modality) for modality in verdict.unsupported}
    if None in targets or len(targets) != 1:
        return None  # a video to one model and audio to another: no single place to go
    return targets.pop()


def with_fallback(
    verdict: Verdict,
    matcher: RuleMatcher,
    body_size: int | None = None,
    dialect: DialectOf | None = None,
) -> Verdict:
    """The verdict for the fallback model (``model`` rewritten, its own rule's limits, read
    in the dialect of the server that serves it), or ``verdict`` unchanged when no
    fallback applies."""
    target = fallback_target(verdict)
    if target is None or verdict.request is None:
        return verdict
    rerouted = validate_request(
        {**verdict.request, "model": target},
        matcher,
        body_size,
        api=verdict.api,
        dialect=dialect,
    )
    assert verdict.rule is not None
    return replace(rerouted, routed_from=verdict.rule.name)
