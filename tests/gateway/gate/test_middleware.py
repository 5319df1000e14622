"""ModalGate as ASGI middleware: what it reads, what it lets through, how it answers."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections.abc import Iterator

import anyio
import httpx
import orjson
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket

from conftest import body, chat, data_url, image_bytes, image_part, parse_url, serve
from modalgate import ModalGate, get_verdict
from modalgate.policy import parse_policy

SMALL_CAP_POLICY = parse_policy(
    """
limits: {max_body_bytes: 4096}
models:
  - name: big-model
    accepts: [image]
    limits: {max_body_bytes: 8192}
""",
    fmt="yaml",
)


async def echo_digest(request: Request):
    raw = await request.body()
    verdict = get_verdict(request.scope)
    return JSONResponse(
        {
            "sha256": hashlib.sha256(raw).hexdigest(),
            "length": len(raw),
            "verdict": verdict.to_dict() if verdict else None,
        }
    )


async def plain(request: Request):
    return PlainTextResponse(f"{request.method} {request.url.path}")


async def ws_echo(websocket: WebSocket):
    await websocket.accept()
    await websocket.send_text(await websocket.receive_text())
    await websocket.close()


def starlette_app(**gate) -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/chat/completions", echo_digest, methods=["POST", "GET"]),
            Route("/chat/completions", echo_digest, methods=["POST"]),
            Route("/v1/models", plain),
            Route("/v1/embeddings", echo_digest, methods=["POST"]),
            Route("/v1/other", echo_digest, methods=["POST"]),
            WebSocketRoute("/ws", ws_echo),
        ],
        middleware=[Middleware(ModalGate, **gate)],
    )


@pytest.fixture(scope="module")
def gated_url() -> Iterator[str]:
    with serve(starlette_app(policy=SMALL_CAP_POLICY)) as url:
        yield url


def test_accepted_body_replayed_and_verdict_attached(gated_url):
    raw = body(chat(image_part(data_url(image_bytes())), model="big-model"))
    response = httpx.post(
        gated_url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200
    echoed = response.json()
    assert echoed["sha256"] == hashlib.sha256(raw).hexdigest()
    assert echoed["verdict"]["accepted"] is True
    assert echoed["verdict"]["media"][0]["param"] == "messages.[0].content.[0]"


def test_chunked_body_accepted_and_replayed(gated_url):
    raw = body(chat(image_part(data_url(image_bytes())), model="big-model"))

    def pieces():
        for start in range(0, len(raw), 100):
            yield raw[start : start + 100]

    response = httpx.post(
        gated_url + "/chat/completions",
        content=pieces(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200
    assert response.json()["sha256"] == hashlib.sha256(raw).hexdigest()


def test_body_over_cap_with_content_length_is_413(gated_url):
    raw = body(chat(model="unknown", **{"pad": "x" * 9000}))
    response = httpx.post(
        gated_url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("payload_too_large", None)
    assert "8192" in error["message"]


def test_body_over_cap_chunked_is_413(gated_url):
    def pieces():
        yield b'{"model": "x", "pad": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}'

    response = httpx.post(
        gated_url + "/v1/chat/completions",
        content=pieces(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


def test_per_model_cap_applies_after_parse(gated_url):
    # 5000 bytes: under the read cap (8192, the largest), over the default model cap (4096).
    raw = body(chat(model="some-unknown-model", pad="x" * 5000))
    response = httpx.post(gated_url + "/v1/chat/completions", content=raw)
    assert response.status_code == 413
    ok = httpx.post(
        gated_url + "/v1/chat/completions", content=body(chat(model="big-model", pad="x" * 5000))
    )
    assert ok.status_code == 200


def test_lying_content_length_is_counted_for_real():
    """The declared length is small; the chunks are not: the count decides."""
    gate = ModalGate(_never_called, policy=SMALL_CAP_POLICY)
    chunks = [b"{" + b" " * 5000, b" " * 5000 + b"}"]
    status, sent = anyio.run(_drive, gate, chunks, [(b"content-length", b"10")])
    assert status == 413
    assert orjson.loads(sent)["error"]["code"] == "payload_too_large"


def test_raw_socket_lying_content_length_cannot_smuggle(gated_url):
    """Over a real socket, h11 frames by Content-Length: the extra bytes never join the body."""
    host, port = parse_url(gated_url)
    payload = b'{"model": "big-model", "messages": [{"role": "user", "content": "hi"}]}'
    smuggled = b'{"model": "x"}' + b" " * 20000
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload)
        + payload
        + smuggled
    )
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line = reply.split(b"\r\n", 1)[0]
    assert b" 200 " in status_line
    assert hashlib.sha256(payload).hexdigest().encode() in reply


@pytest.mark.parametrize(
    ("content_type", "status", "code"),
    [
        ("text/plain", 400, "invalid_request"),
        ("application/x-www-form-urlencoded", 400, "invalid_request"),
        ("application/json; charset=utf-8", 200, None),
        ("application/vnd.api+json", 200, None),
    ],
)
def test_content_type(gated_url, content_type, status, code):
    response = httpx.post(
        gated_url + "/v1/chat/completions",
        content=body(chat(model="big-model")),
        headers={"content-type": content_type},
    )
    assert response.status_code == status
    if code:
        assert response.json()["error"]["code"] == code
        assert response.json()["error"]["param"] is None


def test_compressed_body_is_refused(gated_url):
    response = httpx.post(
        gated_url + "/v1/chat/completions",
        content=b"\x1f\x8b\x08\x00",
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


def test_invalid_json_over_http(gated_url):
    response = httpx.post(gated_url + "/v1/chat/completions", content=b'{"model": ')
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_json",
        None,
        "invalid_request_error",
    )


def test_other_methods_and_paths_pass_untouched(gated_url):
    assert httpx.get(gated_url + "/v1/models").text == "GET /v1/models"
    # GET on a gated path is not inspected.
    assert httpx.get(gated_url + "/v1/chat/completions").json()["verdict"] is None
    # POST on a path that is not gated: not JSON, still reaches the app unread.
    response = httpx.post(gated_url + "/v1/other", content=b"not json")
    assert response.status_code == 200
    assert response.json()["length"] == len(b"not json")
    # The engines' other doors (the policy's endpoints) are gated like the chat path.
    response = httpx.post(gated_url + "/v1/embeddings", content=b"not json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_websocket_and_lifespan_pass_through():
    started = []

    async def lifespan(app):
        started.append(True)
        yield

    app = starlette_app(policy=SMALL_CAP_POLICY)
    app.router.lifespan_context = _as_context(lifespan)
    with TestClient(app) as client, client.websocket_connect("/ws") as ws:
        ws.send_text("hello")
        assert ws.receive_text() == "hello"
    assert started == [True]


def test_fetcher_connections_close_with_the_app():
    inner = Starlette(routes=[Route("/v1/models", plain)])
    gate = ModalGate(inner, policy=None)
    with TestClient(gate) as client:
        assert client.get("/v1/models").text == "GET /v1/models"
        assert not gate.media.fetcher.is_closed
    assert gate.media.fetcher.is_closed


def test_disconnect_still_delivered_after_replay():
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append((await receive())["type"])
        seen.append((await receive())["type"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gate = ModalGate(app, policy=SMALL_CAP_POLICY)
    raw = body(chat(model="big-model"))
    status, _ = anyio.run(_drive, gate, [raw], [], True)
    assert status == 204
    assert seen == ["http.request", "http.disconnect"]


def test_client_gone_while_reading_sends_nothing():
    gate = ModalGate(_never_called, policy=SMALL_CAP_POLICY)

    async def run():
        messages = iter(
            [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
        )
        sent = []

        async def receive():
            return next(messages)

        async def send(message):
            sent.append(message)

        await gate(_scope([]), receive, send)
        return sent

    assert anyio.run(run) == []


class Item(BaseModel):
    model: str
    messages: list[dict]


def test_fastapi_add_middleware_and_body_parsing():
    api = FastAPI()
    api.add_middleware(ModalGate, policy=None, mode="encoder")

    @api.post("/v1/chat/completions")
    async def completions(item: Item, request: Request):
        verdict = get_verdict(request.scope)
        return {"model": item.model, "images": len(verdict.parts)}

    with serve(api) as url:
        ok = httpx.post(
            url + "/v1/chat/completions",
            json=chat(image_part(data_url(image_bytes())), model="kimi-k3"),
        )
        assert ok.json() == {"model": "kimi-k3", "images": 1}
        refused = httpx.post(
            url + "/v1/chat/completions",
            json=chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "messages.[0].content.[0].type"


def test_policy_can_be_swapped_while_serving():
    gate = ModalGate(_never_called, policy=None, mode="encoder")
    first = gate.matcher
    gate.set_policy(SMALL_CAP_POLICY)
    assert gate.matcher is not first
    assert gate.policy is SMALL_CAP_POLICY
    assert gate.read_cap == 8192


# ---------------------------------------------------------------- ASGI drivers


async def _never_called(scope, receive, send):  # pragma: no cover - must not run
    raise AssertionError("the app must not be called")


def _scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": headers,
        "query_string": b"",
    }


async def _drive(gate, chunks, headers, disconnect_after=False):
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    if disconnect_after:
        messages.append({"type": "http.disconnect"})
    queue = iter(messages)
    sent: list[dict] = []

    async def receive():
        return next(queue)

    async def send(message):
        sent.append(message)

    await gate(_scope(headers), receive, send)
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:])


def _as_context(generator):
    from contextlib import asynccontextmanager

    return asynccontextmanager(generator)


def test_full_image_decoding_sends_every_body_that_can_hold_an_image_to_a_thread():
    # verify_image_data decodes images (~10-60 ms a megapixel): never on the event loop.
    plain = ModalGate(_noop_app)
    verifying = ModalGate(_noop_app, parse_policy("limits: {verify_image_data: true}", fmt="yaml"))
    per_rule = ModalGate(
        _noop_app,
        parse_policy(
            "models: [{name: a, accepts: [image], limits: {verify_image_data: true}}]", fmt="yaml"
        ),
    )
    assert plain.thread_threshold == 256 * 1024
    assert verifying.thread_threshold == per_rule.thread_threshold == 4 * 1024


async def _noop_app(scope, receive, send) -> None:
    return None


def test_a_big_body_is_validated_off_the_loop_while_small_ones_go_on(monkeypatch):
    """A body over the thread threshold is validated in the gate's threads: a small
    request is answered while that validation is still running."""
    from modalgate.gateway.gate import pipeline

    started, release = threading.Event(), threading.Event()
    validated_in: list[int] = []
    real = pipeline.validate_body

    def held(raw, *args):
        if len(raw) > 256 * 1024:
            validated_in.append(threading.get_ident())
            started.set()
            release.wait(10)
        return real(raw, *args)

    monkeypatch.setattr(pipeline, "validate_body", held)

    async def answer(scope, receive, send) -> None:
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = ModalGate(answer)
    headers = [(b"content-type", b"application/json")]

    async def main() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        long_chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": "x" * 300_000}]}
        big = asyncio.ensure_future(_drive(gate, [body(long_chat)], headers))
        assert await asyncio.to_thread(started.wait, 10), "the big body was never validated"
        small = await asyncio.wait_for(_drive(gate, [body(chat())], headers), 10)
        release.set()
        return small, await big

    small, big = asyncio.run(main())
    assert small == (200, b"ok") and big == (200, b"ok")
    assert validated_in and validated_in[0] != threading.get_ident()
