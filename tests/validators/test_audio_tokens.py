"""Audio token estimates equal what Qwen2-Audio's processor writes for the same clip.

The processor's count comes from Whisper's feature extractor (transformers
``WhisperFeatureExtractor``, the one ``Qwen2AudioProcessor`` holds: 16 kHz, padded to
30 s) and the processor's own formula over its attention mask; the gate's comes from
the clip's counted length and rate. End to end, a real WAV part carries the count.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import transformers
from av_media import make_audio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import b64, body, chat
from modalgate.policy import RuleMatcher, load_policy
from modalgate.policy.models import TokenSpec
from modalgate.validators import validate_body
from modalgate.validators.audio_tokens import estimate_audio_tokens

SPEC = TokenSpec(family="whisper", audio_family="qwen2_audio")


@pytest.fixture(scope="module")
def extractor() -> transformers.WhisperFeatureExtractor:
    return transformers.WhisperFeatureExtractor()


def processor_tokens(extractor: transformers.WhisperFeatureExtractor, samples: np.ndarray) -> int:
    """``Qwen2AudioProcessor``'s ``num_audio_tokens`` for one clip at 16 kHz."""
    features = extractor(
        samples, sampling_rate=16_000, padding="max_length", return_attention_mask=True
    )
    length = int(np.sum(features["attention_mask"]))
    return (((length - 1) // 2 + 1) - 2) // 2 + 1


@settings(max_examples=150, deadline=None)
@given(samples=st.integers(160, 700_000))
def test_the_estimate_equals_the_processors_count(extractor, samples):
    clip = np.zeros(samples, np.float32)
    assert estimate_audio_tokens(samples / 16_000, 16_000, SPEC) == processor_tokens(
        extractor, clip
    )


@pytest.mark.parametrize("seconds", [0.5, 7.3, 29.0, 45.0])
def test_a_wav_part_carries_the_processors_count(extractor, seconds):
    data = make_audio("wav", seconds=seconds)
    part = {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}
    matcher = RuleMatcher(load_policy(), None)
    verdict = validate_body(body(chat(part, model="Qwen/Qwen2-Audio-7B-Instruct")), matcher)
    if seconds > 30:
        [violation] = verdict.violations
        assert violation.code.value == "media_too_large"  # the extractor's 30 s window
        return
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    with av.open(io.BytesIO(data)) as container:
        samples = np.concatenate([f.to_ndarray()[0] for f in container.decode(audio=0)])
    assert verdict.parts[0].tokens == processor_tokens(extractor, samples.astype(np.float32))
