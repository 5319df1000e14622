"""Stage two of the flow: pure, synchronous request validation (no I/O, no awaits)."""

from modalgate.validators.request import check_fetched, validate_body, validate_request
from modalgate.validators.routing import fallback_target, with_fallback
from modalgate.validators.verdict import MediaPart, Verdict

__all__ = [
    "MediaPart",
    "Verdict",
    "check_fetched",
    "fallback_target",
    "validate_body",
    "validate_request",
    "with_fallback",
]
