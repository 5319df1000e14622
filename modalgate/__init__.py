"""modalgate: refuse what a multimodal model cannot take, at the door, with one precise 400."""

from modalgate.errors import ErrorCode, Violation
from modalgate.gateway import ModalGate, get_verdict
from modalgate.policy import Policy, PolicyError, load_policy
from modalgate.validators import MediaPart, Verdict

__version__ = "0.1.0"

__all__ = [
    "ErrorCode",
    "MediaPart",
    "ModalGate",
    "Policy",
    "PolicyError",
    "Verdict",
    "Violation",
    "get_verdict",
    "load_policy",
]
