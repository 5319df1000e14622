"""Vision-token budgets in validation: per image, per request, and shapes processors refuse."""

from __future__ import annotations

import pytest

from conftest import body, chat, data_url, image_bytes, image_part
from modalgate.errors import ErrorCode
from modalgate.policy import PolicyError, RuleMatcher, parse_policy
from modalgate.validators import validate_body

BUDGETS = """
extends: builtin
limits: {max_image_tokens: 4096, max_request_image_tokens: 8192}
"""
QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(parse_policy(BUDGETS, fmt="yaml"), "encoder")


def verdict_for(matcher, *sizes, model=QWEN):
    parts = [image_part(data_url(image_bytes("PNG", size))) for size in sizes]
    return validate_body(body(chat(*parts, model=model)), matcher)


def test_each_image_carries_its_token_count(matcher):
    verdict = verdict_for(matcher, (1000, 200), (28, 28), model=QWEN)
    assert verdict.accepted
    # smart_resize: 1008x196 -> 36x7 patches of 28 -> 252 tokens; 28x28 is below
    # min_pixels (3136) and scales up to 56x56 -> 4 tokens.
    assert [p.tokens for p in verdict.parts] == [252, 4]


def test_kimi_tokens_in_encoder_mode(matcher):
    verdict = verdict_for(matcher, (1920, 1080), model="kimi-k3")
    assert verdict.accepted
    # navit: 1920/14=137 x 1080/14=77 patches fits 65536; pad to 28: 69 x 39 merged tokens.
    assert verdict.parts[0].tokens == 69 * 39


def test_per_image_budget(matcher):
    verdict = verdict_for(matcher, (3000, 2000))
    [violation] = verdict.violations
    assert violation.code is ErrorCode.TOO_MANY_IMAGE_TOKENS
    assert violation.status == 400
    assert violation.param == "messages.[0].content.[0].image_url.url"
    assert "7597 vision tokens; the limit is 4096 per image" in violation.message


def test_request_budget_blames_the_image_that_crosses_it(matcher):
    verdict = verdict_for(matcher, (1800, 1800), (1800, 1800), (1800, 1800))
    [violation] = verdict.violations
    assert violation.code is ErrorCode.TOO_MANY_IMAGE_TOKENS
    assert violation.param == "messages.[0].content.[2].image_url.url"
    assert "12288 vision tokens; the limit is 8192 per request" in violation.message


def test_aspect_ratio_the_processor_refuses(matcher):
    ok = verdict_for(matcher, (6000, 30))  # exactly 200:1 is accepted
    assert ok.accepted
    verdict = verdict_for(matcher, (6000, 29))
    [violation] = verdict.violations
    assert violation.code is ErrorCode.UNSUPPORTED_IMAGE_SHAPE
    assert violation.param == "messages.[0].content.[0].image_url.url"


def test_fixed_family_counts_per_image(matcher):
    verdict = verdict_for(matcher, (64, 64), (4000, 3000), model="google/gemma-3-27b-it")
    assert [p.tokens for p in verdict.parts] == [256, 256]


def test_families_without_estimator_carry_no_count():
    text = "models:\n  - {name: m, match: [m], accepts: [image], tokens: {family: someday}}\n"
    matcher = RuleMatcher(parse_policy(text, fmt="yaml"))
    verdict = verdict_for(matcher, (640, 480), model="m")
    assert verdict.accepted and verdict.parts[0].tokens is None


def test_llama4_counts_its_tiles(matcher):
    """640x480 on 336 tiles: 2x2 tiles plus the global one, 144 tokens each, plus the
    separator tokens: 727 (tests/validators/test_family_processors.py checks the
    estimator against Llama4Processor itself)."""
    verdict = verdict_for(matcher, (640, 480), model="meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert verdict.accepted and verdict.parts[0].tokens == 727


def test_fixed_family_needs_a_count():
    text = "models:\n  - {name: m, accepts: [image], tokens: {family: fixed}}\n"
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, fmt="yaml", source="p.yaml")
    assert "p.yaml: models.[0].tokens: family 'fixed' needs tokens_per_image" in str(caught.value)
