"""Audio token estimates equal what the Qwen audio processors write for the same clip.

Each processor's count comes from Whisper's feature extractor (transformers
``WhisperFeatureExtractor``, called with the processor class's own ``audio_kwargs``:
Qwen2-Audio and Qwen2.5-Omni pad or cut to 30 s, Qwen3-Omni cuts nothing) and the
formula over its attention mask (for the Omni models, the processor module's own
``_get_feat_extract_output_lengths``); the gate's comes from the clip's counted length
and rate. End to end, a real WAV part carries the count.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
import transformers
from av_media import make_audio
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_5_omni import processing_qwen2_5_omni
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe

from conftest import b64, body, chat
from modalgate.policy import RuleMatcher, load_policy
from modalgate.policy.models import TokenSpec
from modalgate.validators import validate_body
from modalgate.validators.audio_tokens import estimate_audio_tokens
from modalgate.validators.tokens import TokenEstimateError

SPEC = TokenSpec(family="whisper", audio_family="qwen2_audio")
QWEN3_OMNI_SPEC = TokenSpec(family="whisper", audio_family="qwen3_omni")


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


def omni_tokens(extractor, samples: np.ndarray, processor: type, module) -> int:
    """An Omni processor's ``num_audio_tokens``: its extractor call and its own formula."""
    kwargs = dict(processor.audio_kwargs)
    kwargs.pop("sampling_rate")
    features = extractor(samples, sampling_rate=16_000, **kwargs)
    length = torch.tensor(int(np.sum(features["attention_mask"])))
    return int(module._get_feat_extract_output_lengths(length))


@settings(max_examples=150, deadline=None)
@given(samples=st.integers(160, 700_000))
def test_the_estimate_equals_the_processors_count(extractor, samples):
    clip = np.zeros(samples, np.float32)
    assert estimate_audio_tokens(samples / 16_000, 16_000, SPEC) == processor_tokens(
        extractor, clip
    )


@settings(max_examples=60, deadline=None)
@given(samples=st.integers(160, 700_000))
def test_the_qwen2_5_omni_processors_count_is_qwen2_audios(extractor, samples):
    clip = np.zeros(samples, np.float32)
    processor = processing_qwen2_5_omni.Qwen2_5OmniProcessor
    expected = omni_tokens(extractor, clip, processor, processing_qwen2_5_omni)
    assert estimate_audio_tokens(samples / 16_000, 16_000, SPEC) == expected


@settings(max_examples=100, deadline=None)
@given(samples=st.integers(201, 1_600_000))
def test_the_qwen3_omni_estimate_equals_its_processors_count(extractor, samples):
    clip = np.zeros(samples, np.float32)
    processor = processing_qwen3_omni_moe.Qwen3OmniMoeProcessor
    expected = omni_tokens(extractor, clip, processor, processing_qwen3_omni_moe)
    assert estimate_audio_tokens(samples / 16_000, 16_000, QWEN3_OMNI_SPEC) == expected


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


def test_a_clip_too_short_for_qwen3_omnis_extractor_is_refused(extractor):
    processor = processing_qwen3_omni_moe.Qwen3OmniMoeProcessor
    with pytest.raises(RuntimeError, match="Padding size"):  # what the server would meet
        omni_tokens(extractor, np.zeros(200, np.float32), processor, processing_qwen3_omni_moe)
    with pytest.raises(TokenEstimateError, match="at least 201 samples at 16 kHz"):
        estimate_audio_tokens(200 / 16_000, 16_000, QWEN3_OMNI_SPEC)
    assert estimate_audio_tokens(201 / 16_000, 16_000, QWEN3_OMNI_SPEC) == 1
    data = make_audio("wav", seconds=0.01)
    part = {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}
    matcher = RuleMatcher(load_policy(), None)
    at = "messages.[0].content.[0].input_audio.data"
    verdict = validate_body(body(chat(part, model="Qwen/Qwen3-Omni-30B-A3B-Instruct")), matcher)
    [violation] = verdict.violations
    assert (violation.code.value, violation.param) == ("media_too_small", at)
    assert violation.message == f"{at}: audio is 10 ms long; this model needs at least 100 ms"
    # Padded to its window first, Qwen2.5-Omni's extractor takes it, and makes no tokens.
    verdict = validate_body(body(chat(part, model="Qwen/Qwen2.5-Omni-7B")), matcher)
    [violation] = verdict.violations
    assert (violation.code.value, violation.param) == ("media_too_small", at)
    assert violation.message == (
        f"{at}: the audio is too short for this model (it makes no audio tokens)"
    )
    assert processor_tokens(extractor, np.zeros(160, np.float32)) == 0


@pytest.mark.parametrize(
    ("model", "expected"),
    [("Qwen/Qwen2.5-Omni-7B", "qwen2"), ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3")],
)
@pytest.mark.parametrize("seconds", [0.5, 7.3, 45.0])
def test_an_omni_wav_part_carries_its_processors_count(extractor, model, expected, seconds):
    data = make_audio("wav", seconds=seconds)
    part = {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}
    verdict = validate_body(body(chat(part, model=model)), RuleMatcher(load_policy(), None))
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    with av.open(io.BytesIO(data)) as container:
        samples = np.concatenate([f.to_ndarray()[0] for f in container.decode(audio=0)])
    processor, module = {
        "qwen2": (processing_qwen2_5_omni.Qwen2_5OmniProcessor, processing_qwen2_5_omni),
        "qwen3": (processing_qwen3_omni_moe.Qwen3OmniMoeProcessor, processing_qwen3_omni_moe),
    }[expected]
    counted = omni_tokens(extractor, samples.astype(np.float32), processor, module)
    assert verdict.parts[0].tokens == counted
