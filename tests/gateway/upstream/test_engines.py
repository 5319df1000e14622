"""Which dialect a rule's requests are read in when its route balances several upstreams:
the engine they all are, ``openai`` where they differ, the rule's own ``engine`` first."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import pytest

from modalgate.gateway.upstream.balancer import Upstreams
from modalgate.gateway.upstream.engines import EngineDialects
from modalgate.gateway.upstream.proxy import UpstreamSettings
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.settings import GatewaySettings

A = "http://127.0.0.1:9101"
B = "http://127.0.0.1:9102"
POLICY = f"""
extends: builtin
models:
  - {{name: pair, match: [pair], accepts: [image], upstream: [{{url: '{A}'}}, {{url: '{B}'}}]}}
  - name: pinned
    match: [pinned]
    accepts: [image]
    engine: sglang
    upstream: [{{url: '{A}'}}, {{url: '{B}'}}]
"""


@pytest.fixture
def setup() -> Iterator[tuple[RuleMatcher, Upstreams, EngineDialects]]:
    matcher = RuleMatcher(parse_policy(POLICY, fmt="yaml"), None)
    upstreams = Upstreams(None, UpstreamSettings(), "/health")
    upstreams.use_policy(matcher.rules)
    yield matcher, upstreams, EngineDialects(upstreams, GatewaySettings())
    anyio.run(upstreams.aclose)


def engines(upstreams: Upstreams, a: str | None, b: str | None) -> None:
    upstreams.targets[A].engine = a
    upstreams.targets[B].engine = b


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_targets_of_one_engine_are_read_in_its_dialect(setup, engine):
    matcher, upstreams, dialects = setup
    engines(upstreams, engine, engine)
    assert dialects(matcher.resolve("pair")).engine == engine


def test_a_vllm_and_an_sglang_are_read_as_openai_and_logged_once(setup, caplog):
    matcher, upstreams, dialects = setup
    engines(upstreams, "vllm", "sglang")
    with caplog.at_level(logging.WARNING, "modalgate.routes"):
        assert dialects(matcher.resolve("pair")).engine == "openai"
        assert dialects(matcher.resolve("pair")).engine == "openai"
    (record,) = [r for r in caplog.records if "different engines" in r.getMessage()]
    assert record.fields == {"route": "pair", "engines": ["sglang", "vllm"]}
    engines(upstreams, "sglang", "vllm")  # the same mix the other way round: no new line
    with caplog.at_level(logging.WARNING, "modalgate.routes"):
        assert dialects(matcher.resolve("pair")).engine == "openai"
    assert len([r for r in caplog.records if "different engines" in r.getMessage()]) == 1


@pytest.mark.parametrize("known", [(None, "vllm"), ("vllm", None)])
def test_a_target_not_read_yet_makes_the_reading_openai_whatever_the_order(setup, known):
    matcher, upstreams, dialects = setup
    engines(upstreams, *known)
    assert dialects(matcher.resolve("pair")).engine == "openai"


def test_the_rules_own_engine_wins(setup):
    matcher, upstreams, dialects = setup
    engines(upstreams, "vllm", "vllm")
    assert dialects(matcher.resolve("pinned")).engine == "sglang"
    engines(upstreams, "vllm", "sglang")
    assert dialects(matcher.resolve("pinned")).engine == "sglang"
