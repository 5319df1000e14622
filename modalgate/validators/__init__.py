"""Stage two of the flow: pure, synchronous request validation (no I/O, no awaits)."""

from modalgate.validators.request import validate_body, validate_request
from modalgate.validators.verdict import MediaPart, Verdict

__all__ = ["MediaPart", "Verdict", "validate_body", "validate_request"]
