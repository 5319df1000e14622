"""Output a model cannot produce: OpenAI's ``modalities`` and ``audio`` (the voice to answer
in) are refused for a text-out model in every API that carries them, with their param;
engines would answer in text alone. SGLang's native ``modalities`` (an input hint) is not
an output request."""

from __future__ import annotations

import orjson
import pytest

from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.validators import validate_body

USER = [{"role": "user", "content": "say hi"}]
VOICE = {"voice": "alloy", "format": "wav"}


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(load_policy(), None)


def _refusal(matcher: RuleMatcher, body: dict, api: str = "chat") -> tuple[str, str] | None:
    verdict = validate_body(orjson.dumps(body), matcher, api)
    if verdict.accepted:
        return None
    return verdict.violations[0].code.value, verdict.violations[0].param


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        ("chat", {"messages": USER, "modalities": ["text", "audio"]}, "modalities.[1]"),
        ("chat", {"messages": USER, "audio": VOICE}, "audio"),
        ("chat_batch", {"messages": [USER], "modalities": ["audio"]}, "modalities.[0]"),
        ("responses", {"input": "hi", "modalities": ["audio"]}, "modalities.[0]"),
        ("invocations", {"messages": USER, "audio": VOICE}, "audio"),
    ],
)
def test_audio_output_is_refused_for_a_text_out_model(matcher, api, body, param):
    body = {"model": "kimi-k3", **body}
    assert _refusal(matcher, body, api) == ("unsupported_modality", param)


def test_a_model_that_speaks_may_be_asked_to(matcher):
    body = {"model": "gpt-4o-audio-preview", "messages": USER, "modalities": ["text", "audio"]}
    assert _refusal(matcher, {**body, "audio": VOICE}) is None
    assert _refusal(matcher, {"model": "kimi-k3", "messages": USER, "modalities": ["text"]}) is None


def test_sglang_native_modalities_are_an_input_hint(matcher):
    body = {"text": "hi", "modalities": ["image", "multi-images"], "model": "kimi-k3"}
    assert _refusal(matcher, body, "generate") is None


def test_produces_is_policy_data():
    policy = parse_policy(
        "models:\n  - {name: talker, accepts: [audio], produces: [text, audio]}\n", fmt="yaml"
    )
    matcher = RuleMatcher(policy, None)
    assert _refusal(matcher, {"model": "talker", "messages": USER, "audio": VOICE}) is None
    assert matcher.resolve("talker").produces == {"text", "audio"}
