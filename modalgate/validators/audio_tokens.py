"""Audio tokens from a clip's counted length and sample rate alone (Qwen2-Audio).

Qwen2-Audio's processor (transformers ``Qwen2AudioProcessor``) runs Whisper's feature
extractor at 16 kHz, padded to its 30 s window, and writes one audio token per
two of the encoder's frames, which are half the feature frames: a clip of ``L``
feature frames (one per 160 samples, at most 3000) costs
``((L - 1) // 2 + 1 - 2) // 2 + 1`` tokens. Checked against the feature extractor in
``tests/validators/test_audio_tokens.py``. The sample count is the counted length at
the file's rate, brought to 16 kHz as a resampler does (rounded up); for compressed
audio the counted length includes the encoder's priming, so the estimate may be a
frame or two over.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from modalgate.policy.models import TokenSpec

WHISPER_RATE = 16_000
WHISPER_HOP = 160
WHISPER_FRAMES = 3000  # 30 s


def qwen2_audio_tokens(seconds: float, sample_rate: int, spec: TokenSpec) -> int:
    samples = round(seconds * sample_rate)
    resampled = math.ceil(samples * WHISPER_RATE / sample_rate)
    frames = min(math.ceil(resampled / WHISPER_HOP), WHISPER_FRAMES)
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


AudioEstimator = Callable[[float, int, TokenSpec], int]
AUDIO_ESTIMATORS: dict[str, AudioEstimator] = {"qwen2_audio": qwen2_audio_tokens}


def estimate_audio_tokens(seconds: float, sample_rate: int, spec: TokenSpec) -> int | None:
    """The spec's audio family's estimate, or ``None`` where it names none."""
    estimator = AUDIO_ESTIMATORS.get(spec.audio_family or "")
    return None if estimator is None else estimator(seconds, sample_rate, spec)
