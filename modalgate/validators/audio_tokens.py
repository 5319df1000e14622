"""Audio tokens from a clip's counted length and sample rate alone (the Qwen audio models).

All three processors run Whisper's feature extractor at 16 kHz (one feature frame
per 160 samples, counted by its attention mask) and pass the frame count through
their encoder's output-length formula:

- ``qwen2_audio`` (transformers ``Qwen2AudioProcessor`` and ``Qwen2_5OmniProcessor``,
  whose ``_get_feat_extract_output_lengths`` is the same): the clip padded or cut to
  the extractor's window (30 s, 3000 frames, unless ``audio_window_seconds`` says
  otherwise), then ``((L - 1) // 2 + 1 - 2) // 2 + 1`` tokens.
- ``qwen3_omni`` (``Qwen3OmniMoeProcessor``: ``padding=True, truncation=False``,
  nothing cut): 13 tokens per whole chunk of 100 frames (``n_window`` 50), and the
  rest through two more stride-2 convolutions. Unpadded, a clip of 200 samples or
  fewer at 16 kHz makes the extractor's STFT raise, so it is refused
  (``media_too_small``).

Checked against the extractor and each processor module's own formula in
``tests/validators/test_audio_tokens.py``. The sample count is the counted length at
the file's rate, brought to 16 kHz as a resampler does (rounded up); for compressed
audio the counted length includes the encoder's priming, so the estimate may be a
frame or two over.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from modalgate.policy.models import TokenSpec
from modalgate.validators.tokens import TokenEstimateError

WHISPER_RATE = 16_000
WHISPER_HOP = 160
WHISPER_REFLECT_PAD = 200  # n_fft // 2: torch's reflect padding needs more samples than this
WHISPER_WINDOW_SECONDS = 30
QWEN3_OMNI_CHUNK_FRAMES = 100  # n_window * 2
QWEN3_OMNI_TOKENS_PER_CHUNK = 13


def whisper_feature_frames(seconds: float, sample_rate: int, window_seconds: float | None) -> int:
    """The extractor's attention-mask length at 16 kHz.

    Padded to its window, the mask counts every started hop (ceil), at most the
    window's frames; with ``None`` (``padding=True``, nothing cut) the STFT's last
    frame is dropped, so only whole hops count (floor).
    """
    samples = math.ceil(round(seconds * sample_rate) * WHISPER_RATE / sample_rate)
    if window_seconds is None:
        if samples <= WHISPER_REFLECT_PAD:
            raise TokenEstimateError(
                f"the audio is too short for this model's feature extractor (at least"
                f" {WHISPER_REFLECT_PAD + 1} samples at 16 kHz)"
            )
        return samples // WHISPER_HOP
    return min(math.ceil(samples / WHISPER_HOP), int(window_seconds * WHISPER_RATE) // WHISPER_HOP)


def qwen2_audio_tokens(seconds: float, sample_rate: int, spec: TokenSpec) -> int:
    window = spec.audio_window_seconds or WHISPER_WINDOW_SECONDS
    frames = whisper_feature_frames(seconds, sample_rate, window)
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def qwen3_omni_audio_tokens(seconds: float, sample_rate: int, spec: TokenSpec) -> int:
    frames = whisper_feature_frames(seconds, sample_rate, spec.audio_window_seconds)
    rest = (frames % QWEN3_OMNI_CHUNK_FRAMES - 1) // 2 + 1
    whole = frames // QWEN3_OMNI_CHUNK_FRAMES * QWEN3_OMNI_TOKENS_PER_CHUNK
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + whole


AudioEstimator = Callable[[float, int, TokenSpec], int]
AUDIO_ESTIMATORS: dict[str, AudioEstimator] = {
    "qwen2_audio": qwen2_audio_tokens,
    "qwen3_omni": qwen3_omni_audio_tokens,
}


def estimate_audio_tokens(seconds: float, sample_rate: int, spec: TokenSpec) -> int | None:
    """The spec's audio family's estimate, or ``None`` where it names none."""
    estimator = AUDIO_ESTIMATORS.get(spec.audio_family or "")
    return None if estimator is None else estimator(seconds, sample_rate, spec)
