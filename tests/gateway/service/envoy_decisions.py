"""What every Envoy shape that carries out the whole decision guarantees, held once for
each: the one-message ext_proc config (test_envoy_one_message.py) and the Lua check
(test_envoy_lua.py) import these tests. Each module provides ``envoy`` (its base URL,
a vision pool behind it for requests carrying images) and ``received`` (the text and
vision pools' recorders, emptied).

``with_vision_pool`` adds the second cluster and the route to it, ``pools`` and
``received`` are the recording upstreams.

A fault refused with the gate's status, code and param and nothing let by; a clean body
byte for byte with the decision's headers; routes follow the decision and no client
header moves a request; a rewritten body (media ids bound, per API key) with its
Content-Length; a request the gate does not judge untouched. Over HTTP/1.1 and HTTP/2.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from envoy_proc import connection_manager

from conftest import chat, data_url, image_bytes, image_part, serve
from toy_upstream import ToyUpstream

PNG = image_bytes("PNG", (40, 30))
Pools = tuple[ToyUpstream, ToyUpstream, int, int]  # text, vision, and their ports


def with_vision_pool(config: dict[str, Any], vision_port: int, match: dict[str, Any]) -> None:
    """A second cluster, ``vision_pool``, and ahead of the config's route one to it for
    requests that ``match`` adds (the decision saying ``image``): docs/envoy.md's pools."""
    clusters = config["static_resources"]["clusters"]
    vision = copy.deepcopy(clusters[0])
    vision["name"] = vision["load_assignment"]["cluster_name"] = "vision_pool"
    endpoint = vision["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["port_value"] = vision_port
    clusters.append(vision)
    routes = connection_manager(config)["route_config"]["virtual_hosts"][0]["routes"]
    image_route = copy.deepcopy(routes[0])
    image_route["match"].update(match)
    image_route["route"]["cluster"] = "vision_pool"
    routes.insert(0, image_route)


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    text, vision = ToyUpstream("text"), ToyUpstream("vision")
    with serve(text.app()) as text_url, serve(vision.app()) as vision_url:
        yield text, vision, httpx.URL(text_url).port, httpx.URL(vision_url).port


@pytest.fixture
def received(pools: Pools) -> Iterator[tuple[ToyUpstream, ToyUpstream]]:
    text, vision, _, _ = pools
    text.received.clear()
    vision.received.clear()
    yield text, vision


@pytest.fixture(params=["http1", "http2"])
def http(request, envoy) -> Iterator[httpx.Client]:
    http2 = request.param == "http2"
    with httpx.Client(base_url=envoy, http1=not http2, http2=http2, timeout=30) as client:
        yield client


def post(http: httpx.Client, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    sent = {"content-type": "application/json", **headers}
    return http.post("/v1/chat/completions", content=content, headers=sent)


def test_a_fault_is_refused_with_the_gates_status_code_and_param(http, received):
    answer = post(http, chat(image_part(data_url(PNG[:40]))))
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["param"]) == (
        400,
        "invalid_image",
        "messages.[0].content.[0].image_url.url",
    )
    assert answer.headers["content-type"] == "application/json"
    assert received[0].received == received[1].received == []


def test_a_clean_body_goes_on_byte_for_byte_with_the_decision(http, received):
    text, vision = received
    raw = orjson.dumps(chat())
    answer = post(http, raw, **{"x-modalgate-modalities": "text,image", "x-modalgate-x": "1"})
    assert answer.status_code == 200
    assert vision.received == []
    (got,) = text.received
    assert got.body == raw
    assert got.headers["x-modalgate-modalities"] == "text"  # the decision, not the client's
    assert got.headers["x-modalgate-model"] == "kimi-k3"
    assert got.headers["x-modalgate-rule"] == "kimi-k3"
    assert "x-modalgate-x" not in got.headers


def test_images_route_to_the_vision_pool_whatever_the_client_claims(http, received):
    text, vision = received
    answer = post(http, chat(image_part(data_url(PNG))), **{"x-modalgate-modalities": "text"})
    assert answer.status_code == 200
    assert text.received == []
    (got,) = vision.received
    assert got.headers["x-modalgate-modalities"] == "text,image"


def test_a_text_request_claiming_images_stays_on_the_text_pool(http, received):
    text, vision = received
    claimed = {"x-modalgate-modalities": "text,image"}
    assert post(http, chat(), **claimed).status_code == 200
    assert vision.received == []
    assert len(text.received) == 1


def test_a_rewritten_body_goes_on_with_its_length(http, received):
    """Media ids bound per API key: two keys, two ids, each body with its Content-Length."""
    _, vision = received
    part = {**image_part(data_url(PNG)), "uuid": "photo"}
    ids = []
    for key in ("key-a", "key-b"):
        assert post(http, chat(part), authorization=f"Bearer {key}").status_code == 200
        got = vision.received.pop()
        assert int(got.headers["content-length"]) == len(got.body)
        ids.append(orjson.loads(got.body)["messages"][0]["content"][0]["uuid"])
    assert ids[0] != ids[1] and "photo" not in ids
    reference = {"type": "image_url", "image_url": None, "uuid": "photo"}
    refused = post(http, chat(reference), authorization="Bearer key-c")
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "unknown_media_id")


def test_what_the_gate_does_not_judge_goes_on_untouched(http, received):
    text, _ = received
    answer = http.get("/v1/models")
    assert answer.status_code == 200
    assert [r.path for r in text.received] == ["/v1/models"]
