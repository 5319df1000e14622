"""Shadow mode through a real gateway and the recording upstream: a refusal it covers is
forwarded, named in ``x-modalgate-shadow``, counted and logged; what it never covers
(unreadable bodies, 413s, refused or unfetchable URLs) is still refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import orjson
import pybase64
import pytest

from conftest import (
    MP4_BYTES,
    Recorder,
    chat,
    data_url,
    image_bytes,
    image_part,
    send_body,
    serve,
    start_server,
)
from gateway_proc import GatewayProcess, metric
from modalgate.gateway.app import create_app
from modalgate.gateway.gate.shadow import shadow_in_effect
from modalgate.gateway.observability.startup import in_effect
from modalgate.policy import RuleMatcher
from modalgate.policy.loading import parse_policy
from toy_upstream import ToyUpstream

PNG = image_bytes("PNG", (40, 30))
VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
POLICY = """
enforce: {enforce}
media_urls:
  schemes: [data, https, http]
  allow_private: ["127.0.0.1/32"]
models:
  - name: shadowed-vision
    accepts: [image]
    enforce: false
    limits: {{max_body_bytes: 8192}}
  - name: text-only
    accepts: []
  - name: strict-text
    accepts: []
    enforce: true
  - name: video-model
    accepts: [video]
    enforce: true
    limits: {{max_videos: 1}}
  - name: shadowed-router
    accepts: [image]
    enforce: false
    fallback: {{video: video-model}}
  - name: image-router
    accepts: []
    enforce: true
    fallback: {{image: lenient-vision}}
  - name: lenient-vision
    accepts: [image]
    enforce: false
    limits: {{max_images: 1}}
"""


@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[ToyUpstream, str]]:
    upstream = ToyUpstream()
    with serve(upstream.app()) as base:
        yield upstream, base


@pytest.fixture(scope="module")
def media() -> Iterator[Recorder]:
    routes = {"/a.png": lambda handler: send_body(handler, PNG)}
    server = start_server(Recorder(("127.0.0.1", 0), routes))
    yield server
    server.shutdown()


def gateway(tmp_path: Path, base: str, enforce: bool) -> Iterator[str]:
    policy = tmp_path / f"policy-{enforce}.yaml"
    policy.write_text(POLICY.format(enforce=str(enforce).lower()), encoding="utf-8")
    with serve(create_app(policy, upstream=base)) as url:
        yield url


@pytest.fixture(scope="module")
def per_rule(toy, tmp_path_factory) -> Iterator[str]:
    yield from gateway(tmp_path_factory.mktemp("per-rule"), toy[1], enforce=True)


@pytest.fixture(scope="module")
def everywhere(toy, tmp_path_factory) -> Iterator[str]:
    yield from gateway(tmp_path_factory.mktemp("global"), toy[1], enforce=False)


@pytest.fixture
def received(toy) -> list:
    toy[0].received.clear()
    return toy[0].received


def chats(received: list) -> list:
    """What reached the upstream's chat path (model list reads and probes left out)."""
    return [r for r in received if r.path == "/v1/chat/completions"]


def post(base: str, request: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    content = request if isinstance(request, bytes) else orjson.dumps(request)
    headers = {"content-type": "application/json"}
    return httpx.post(base + path, content=content, headers=headers, timeout=10)


def counted(base: str, name: str, **labels: str) -> float:
    return metric(SimpleNamespace(url=base), name, **labels)


def test_a_shadowed_rule_forwards_the_refused_request_and_names_the_refusal(per_rule, received):
    request = chat(VIDEO, model="shadowed-vision")
    before = counted(per_rule, "modalgate_shadow_refusals_total", model="shadowed-vision")
    response = post(per_rule, request)
    assert response.status_code == 200
    assert response.headers["x-modalgate-shadow"] == (
        "unsupported_modality; param=messages.[0].content.[0].type"
    )
    [forwarded] = chats(received)
    assert forwarded.body == orjson.dumps(request)  # as the client sent it
    labels = {"model": "shadowed-vision", "code": "unsupported_modality"}
    assert counted(per_rule, "modalgate_shadow_refusals_total", **labels) == before + 1
    shadowed = {"model": "shadowed-vision", "outcome": "shadowed", "code": "unsupported_modality"}
    assert counted(per_rule, "modalgate_requests_total", **shadowed) >= 1


def test_a_responses_api_request_is_shadowed_the_same_way(per_rule, received):
    request = {
        "model": "shadowed-vision",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, VIDEO]}],
    }
    response = post(per_rule, request, path="/v1/responses")
    assert response.status_code == 200
    assert response.headers["x-modalgate-shadow"] == (
        "unsupported_modality; param=input.[0].content.[1].type"
    )
    assert [r.path for r in received if r.path == "/v1/responses"] == ["/v1/responses"]


def test_a_rule_that_enforces_still_refuses(per_rule, received):
    response = post(per_rule, chat(VIDEO, model="text-only"))
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "unsupported_modality")
    assert error["param"] == "messages.[0].content.[0].type"
    assert "x-modalgate-shadow" not in response.headers
    assert chats(received) == []


def test_an_accepted_request_carries_no_shadow_header(per_rule, received):
    response = post(per_rule, chat(image_part(data_url(PNG)), model="shadowed-vision"))
    assert response.status_code == 200
    assert "x-modalgate-shadow" not in response.headers
    assert len(chats(received)) == 1


def test_the_rules_in_shadow_mode_are_named_at_start(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(enforce="false"), encoding="utf-8")
    gateway = create_app(policy, upstream="http://127.0.0.1:9")
    assert in_effect(gateway)["shadow"] == (
        "shadowed-vision, text-only, shadowed-router, lenient-vision, unknown models"
    )
    per_rule = tmp_path / "per-rule.yaml"
    per_rule.write_text(POLICY.format(enforce="true"), encoding="utf-8")
    assert in_effect(create_app(per_rule, upstream="http://127.0.0.1:9"))["shadow"] == (
        "shadowed-vision, shadowed-router, lenient-vision"
    )
    assert in_effect(create_app(per_rule))["shadow"] is None  # a dry run answers the verdict


def test_no_enforce_names_the_embeds_rules_it_cannot_shadow():
    policy = parse_policy(
        "models:\n"
        "  - {name: tower-a, accepts: [image], embeds: {}}\n"
        "  - {name: plain, accepts: [image]}\n"
        "  - {name: tower-b, accepts: [image], embeds: {}}\n",
        fmt="yaml",
    )
    matcher = RuleMatcher(policy)
    assert shadow_in_effect(matcher, False) == "every rule but embeds rules: tower-a, tower-b"
    assert shadow_in_effect(matcher, None) is None
    plain = parse_policy("models:\n  - {name: plain, accepts: [image]}\n", fmt="yaml")
    assert shadow_in_effect(RuleMatcher(plain), False) == "every rule"


def test_enforce_false_at_the_top_shadows_every_rule_but_one_that_says_true(everywhere, received):
    response = post(everywhere, chat(VIDEO, model="text-only"))
    assert response.status_code == 200
    assert response.headers["x-modalgate-shadow"].startswith("unsupported_modality; param=")
    unknown = post(everywhere, chat(VIDEO, model="no-such-model"))
    assert unknown.status_code == 200  # unknown models follow the top level
    strict = post(everywhere, chat(VIDEO, model="strict-text"))
    assert (strict.status_code, strict.json()["error"]["code"]) == (400, "unsupported_modality")
    assert len(chats(received)) == 2
    labels = {"model": "text-only", "code": "unsupported_modality"}
    assert counted(everywhere, "modalgate_shadow_refusals_total", **labels) >= 1


@pytest.mark.parametrize(
    ("request_body", "status", "code"),
    [
        pytest.param(b'{"model": "shadowed-vision", "messages": [', 400, "invalid_json", id="json"),
        pytest.param(
            chat(VIDEO, image_part("http://169.254.169.254/latest/"), model="shadowed-vision"),
            400,
            "url_not_allowed",
            id="ssrf-in-another-part",
        ),
        pytest.param(
            chat(
                {"type": "video_url", "video_url": {"url": "file:///etc/passwd"}},
                model="shadowed-vision",
            ),
            400,
            "url_not_allowed",
            id="ssrf-in-the-refused-part",
        ),
        pytest.param(
            chat({"type": "image_pil", "image_pil": "x"}, VIDEO, model="shadowed-vision"),
            400,
            "unsupported_content_type",
            id="unknown-part",
        ),
        pytest.param(
            chat(VIDEO, {"type": "text", "text": "x" * 9000}, model="shadowed-vision"),
            413,
            "payload_too_large",
            id="over-the-rule-cap",
        ),
    ],
)
def test_what_shadow_mode_never_lets_through(per_rule, received, request_body, status, code):
    response = post(per_rule, request_body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert "x-modalgate-shadow" not in response.headers
    assert chats(received) == []


def test_shadowed_remote_media_is_fetched_checked_and_inlined(per_rule, received, media):
    before = len(media.connections)
    request = chat(VIDEO, image_part(media.base + "/a.png"), model="shadowed-vision")
    response = post(per_rule, request)
    assert response.status_code == 200
    assert response.headers["x-modalgate-shadow"].startswith("unsupported_modality")
    [forwarded] = chats(received)
    url = forwarded.json()["messages"][0]["content"][1]["image_url"]["url"]
    assert pybase64.b64decode(url.removeprefix("data:image/png;base64,")) == PNG
    assert len(media.connections) == before + 1  # the upstream never downloads it


def test_a_shadowed_request_whose_media_cannot_be_fetched_is_refused(per_rule, received, media):
    request = chat(VIDEO, image_part(media.base + "/missing.png"), model="shadowed-vision")
    response = post(per_rule, request)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "media_fetch_failed")
    assert error["param"] == "messages.[0].content.[1].image_url.url"
    assert chats(received) == []


def test_a_fallback_that_takes_the_request_routes_it_without_shadowing(per_rule, received):
    response = post(per_rule, chat(VIDEO, model="shadowed-router"))
    assert response.status_code == 200
    assert response.headers["x-modalgate-routed-to"] == "video-model"
    assert "x-modalgate-shadow" not in response.headers
    [forwarded] = chats(received)
    assert forwarded.json()["model"] == "video-model"


def test_where_the_fallback_refuses_too_the_shadowed_request_goes_on_as_sent(per_rule, received):
    request = chat(VIDEO, VIDEO, model="shadowed-router")  # two videos: video-model takes one
    response = post(per_rule, request)
    assert response.status_code == 200
    assert response.headers["x-modalgate-shadow"] == (
        "unsupported_modality; param=messages.[0].content.[0].type, "
        "unsupported_modality; param=messages.[0].content.[1].type"
    )
    assert "x-modalgate-routed-to" not in response.headers
    [forwarded] = chats(received)
    assert forwarded.body == orjson.dumps(request)


def test_an_enforcing_rules_fallback_that_refuses_is_not_shadowed(per_rule, received):
    # image-router enforces and sends images to lenient-vision (shadow mode, one image):
    # two images were forwarded as sent, model still image-router, which refuses images.
    request = chat(image_part(data_url(PNG)), image_part(data_url(PNG)), model="image-router")
    response = post(per_rule, request)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "too_many_media")
    assert response.headers["x-modalgate-routed-to"] == "lenient-vision"
    assert "x-modalgate-shadow" not in response.headers
    assert chats(received) == []
    one = post(per_rule, chat(image_part(data_url(PNG)), model="image-router"))
    assert one.status_code == 200  # the fallback that takes it still routes it
    assert "x-modalgate-shadow" not in one.headers
    [forwarded] = chats(received)
    assert forwarded.json()["model"] == "lenient-vision"


def test_validate_answers_the_verdict_whatever_the_mode(per_rule, received):
    response = post(per_rule, chat(VIDEO, model="shadowed-vision"), path="/v1/validate")
    assert (response.status_code, response.json()["error"]["code"]) == (
        400,
        "unsupported_modality",
    )
    assert chats(received) == []


def test_no_enforce_flag_shadows_and_logs_the_would_be_refusal(toy, received):
    args = ("--no-enforce", "--upstream", toy[1])
    with GatewayProcess(*args) as process:
        response = post(process.url, chat(VIDEO, model="kimi-k3"))
        assert response.status_code == 200
        line = process.wait_for_log(lambda line: line.get("event") == "request_shadowed")
        started = process.wait_for_log(lambda line: line.get("event") == "gateway started")
    assert started["shadow"] == "every rule"
    assert (line["code"], line["param"], line["status"]) == (
        "unsupported_modality",
        "messages.[0].content.[0].type",
        400,
    )
    assert line["rule"] == "kimi-k3"
    assert len(chats(received)) == 1
