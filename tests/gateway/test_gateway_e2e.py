"""End to end: the official openai client, real uvicorn, a Starlette app behind ModalGate."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from conftest import MP4_BYTES, b64, data_url, image_bytes, serve
from modalgate import ModalGate, get_verdict


class Upstream:
    """A stand-in model server that records what reached it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.verdicts: list[object] = []
        self.release_stream = threading.Event()

    async def chat(self, request: Request):
        raw = await request.body()
        self.bodies.append(raw)
        self.verdicts.append(get_verdict(request.scope))
        payload = json.loads(raw)
        if payload.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return JSONResponse(_completion("ok"))

    async def _stream(self):
        yield _sse(_chunk("first"))
        # The rest waits for the client to have read the first token: proof of no buffering.
        if not await asyncio.to_thread(self.release_stream.wait, 10):
            raise RuntimeError("the client never read the first token")
        yield _sse(_chunk(" second"))
        yield b"data: [DONE]\n\n"

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])


def _completion(text: str) -> dict:
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "kimi-k3",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
    }


def _chunk(text: str) -> dict:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "kimi-k3",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


def _sse(event: dict) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


@pytest.fixture(scope="module")
def upstream():
    return Upstream()


@pytest.fixture(scope="module")
def base_url(upstream):
    with serve(ModalGate(upstream.app(), policy=None, mode="encoder")) as url:
        yield url


@pytest.fixture
def sent_bodies():
    return []


@pytest.fixture
def client(base_url, sent_bodies):
    def record(request: httpx.Request) -> None:
        sent_bodies.append(request.read())

    http = httpx.Client(event_hooks={"request": [record]})
    with openai.OpenAI(
        base_url=base_url + "/v1", api_key="test", http_client=http, max_retries=0
    ) as client:
        yield client


def test_video_to_kimi_k3_encoder_is_a_bad_request(client, upstream):
    before = len(upstream.bodies)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="kimi-k3",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what happens?"},
                        {
                            "type": "video_url",
                            "video_url": {"url": data_url(MP4_BYTES, "video/mp4")},
                        },
                    ],
                }
            ],
        )
    error = caught.value
    assert error.status_code == 400
    assert error.code == "unsupported_modality"
    assert error.param == "messages.[0].content.[1].type"
    assert "Kimi-K3 encoder mode supports image input only" in error.message
    assert error.body["violations"][0]["code"] == "unsupported_modality"
    assert len(upstream.bodies) == before, "a refused request must not reach the app"


def test_clean_image_request_reaches_app_byte_for_byte(client, upstream, sent_bodies):
    url = data_url(image_bytes("JPEG", (320, 240)), "image/jpeg")
    completion = client.chat.completions.create(
        model="moonshotai/Kimi-K3-Instruct",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                ],
            }
        ],
    )
    assert completion.choices[0].message.content == "ok"
    assert upstream.bodies[-1] == sent_bodies[-1]
    verdict = upstream.verdicts[-1]
    assert verdict.accepted
    [part] = verdict.parts
    assert (part.param, part.format, part.width, part.height) == (
        "messages.[0].content.[1]",
        "jpeg",
        320,
        240,
    )


def test_large_accepted_body_is_validated_off_loop_and_replayed(client, upstream, sent_bodies):
    # ~1.2 MB body: above the inline threshold, so validation runs in a worker thread.
    payload = b64(image_bytes("PNG", (16, 16)))
    big_text = "x" * 1_200_000
    client.chat.completions.create(
        model="kimi-k3",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": big_text},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}},
                ],
            }
        ],
    )
    assert hashlib.sha256(upstream.bodies[-1]).digest() == hashlib.sha256(sent_bodies[-1]).digest()


def test_streaming_passes_through_token_by_token(client, upstream):
    upstream.release_stream.clear()
    stream = client.chat.completions.create(
        model="kimi-k3",
        messages=[{"role": "user", "content": "stream please"}],
        stream=True,
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].delta.content == "first"
    upstream.release_stream.set()
    rest = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert rest == " second"


def test_refused_stream_request_gets_plain_json_400(base_url):
    request = {
        "model": "kimi-k3",
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "audio_url", "audio_url": {"url": "https://a.example/x.wav"}}],
            }
        ],
    }
    response = httpx.post(base_url + "/v1/chat/completions", json=request)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "unsupported_modality"


def test_refused_stream_request_raises_in_sdk(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="kimi-k3",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}
                    ],
                }
            ],
            stream=True,
        )
    assert caught.value.code == "url_not_allowed"
    assert caught.value.param == "messages.[0].content.[0].image_url.url"
    assert "169.254" not in caught.value.message
