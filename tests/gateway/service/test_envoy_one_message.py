"""One message each way inside Envoy: deploy/envoy/envoy-extproc-one-message.yaml (request
headers SKIPped, the body BUFFERED with its method and path as attributes and the gate's
headers as metadata; the decision back as dynamic metadata) with ``modalgate extproc``.

What the two-message shape guarantees, held here with the real Envoy and a recording
upstream: a fault refused with the gate's code and param; a clean body goes on byte for
byte; a rewritten body (media ids bound, per API key) goes on with its Content-Length;
routes follow the decision to a second cluster and no client header moves a request; a
request the gate does not judge goes on untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from envoy_proc import config_on_ports, connection_manager, running_envoy
from test_envoy_extproc import Processor

from conftest import REPO_ROOT, chat, data_url, free_port, image_bytes, image_part, serve
from toy_upstream import ToyUpstream

CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy-extproc-one-message.yaml"
PNG = image_bytes("PNG", (40, 30))


def two_pools(listen: int, text_port: int, vision_port: int, processor: int) -> dict[str, Any]:
    """The deploy config with a vision pool: requests carrying images go there (the
    route docs/envoy.md shows), the rest to the model server."""
    config = config_on_ports(
        CONFIG, listen, {"model_server": text_port, "modalgate_extproc": processor}
    )
    clusters = config["static_resources"]["clusters"]
    vision = copy.deepcopy(clusters[0])
    vision["name"] = vision["load_assignment"]["cluster_name"] = "vision_pool"
    endpoint = vision["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["port_value"] = vision_port
    clusters.append(vision)
    routes = connection_manager(config)["route_config"]["virtual_hosts"][0]["routes"]
    image_route = copy.deepcopy(routes[0])
    image_route["match"]["dynamic_metadata"] = [
        {
            "filter": "modalgate",
            "path": [{"key": "modalities"}],
            "value": {"string_match": {"contains": "image"}},
        }
    ]
    image_route["route"]["cluster"] = "vision_pool"
    routes.insert(0, image_route)
    return config


@pytest.fixture(scope="module")
def pools() -> Iterator[tuple[ToyUpstream, ToyUpstream, int, int]]:
    text, vision = ToyUpstream("text"), ToyUpstream("vision")
    with serve(text.app()) as text_url, serve(vision.app()) as vision_url:
        yield text, vision, httpx.URL(text_url).port, httpx.URL(vision_url).port


@pytest.fixture(scope="module")
def envoy(pools) -> Iterator[str]:
    _, _, text_port, vision_port = pools
    with Processor("--engine", "vllm", "--no-access-log") as processor:
        processor.wait_ready()
        config = two_pools(free_port(), text_port, vision_port, processor.grpc_port)
        with running_envoy(config, "/health") as url:
            yield url


@pytest.fixture
def received(pools) -> Iterator[tuple[ToyUpstream, ToyUpstream]]:
    text, vision, _, _ = pools
    text.received.clear()
    vision.received.clear()
    yield text, vision


def post(url: str, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    sent = {"content-type": "application/json", **headers}
    return httpx.post(url + "/v1/chat/completions", content=content, headers=sent, timeout=30)


def test_a_fault_is_refused_with_the_gates_code_and_param(envoy, received):
    answer = post(envoy, chat(image_part(data_url(PNG[:40]))))
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["param"]) == (
        400,
        "invalid_image",
        "messages.[0].content.[0].image_url.url",
    )
    assert received[0].received == received[1].received == []


def test_a_clean_body_goes_on_byte_for_byte_with_the_decision(envoy, received):
    text, vision = received
    raw = orjson.dumps(chat())
    answer = post(envoy, raw, **{"x-modalgate-modalities": "text,image", "x-modalgate-x": "1"})
    assert answer.status_code == 200
    assert vision.received == []
    (got,) = text.received
    assert got.body == raw
    assert got.headers["x-modalgate-modalities"] == "text"  # the decision, not the client's
    assert got.headers["x-modalgate-model"] == "kimi-k3"
    assert "x-modalgate-x" not in got.headers


def test_images_route_to_the_vision_pool_whatever_the_client_claims(envoy, received):
    text, vision = received
    answer = post(envoy, chat(image_part(data_url(PNG))), **{"x-modalgate-modalities": "text"})
    assert answer.status_code == 200
    assert text.received == []
    (got,) = vision.received
    assert got.headers["x-modalgate-modalities"] == "text,image"


def test_a_rewritten_body_goes_on_with_its_length(envoy, received):
    """Media ids bound per API key: two keys, two ids, each body with its Content-Length."""
    _, vision = received
    part = {**image_part(data_url(PNG)), "uuid": "photo"}
    ids = []
    for key in ("key-a", "key-b"):
        assert post(envoy, chat(part), authorization=f"Bearer {key}").status_code == 200
        got = vision.received.pop()
        assert int(got.headers["content-length"]) == len(got.body)
        ids.append(orjson.loads(got.body)["messages"][0]["content"][0]["uuid"])
    assert ids[0] != ids[1] and "photo" not in ids
    reference = {"type": "image_url", "image_url": None, "uuid": "photo"}
    refused = post(envoy, chat(reference), authorization="Bearer key-c")
    assert refused.json()["error"]["code"] == "unknown_media_id"


def test_what_the_gate_does_not_judge_goes_on_untouched(envoy, received):
    text, _ = received
    answer = httpx.get(envoy + "/v1/models", timeout=30)
    assert answer.status_code == 200
    assert [r.path for r in text.received] == ["/v1/models"]
