"""Every judged door of vLLM and SGLang, mounted in the app as vLLM's ``--middleware``
mounts it (``ModalGate(app)``, configured by ``MODALGATE_*`` variables) under a real
uvicorn server: a body that breaks the policy is refused with the same code and param
the chat door gives the same fault, and a clean body reaches the app byte for byte.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from av_media import make_audio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from conftest import b64, data_url, image_bytes, serve
from modalgate import ModalGate
from modalgate.policy.surface import UNJUDGED, engine_doors, kind_of

PNG = image_bytes("PNG", (64, 48))
CUT = PNG[: len(PNG) // 2]  # a truncated PNG: invalid_image wherever it is sent
VIDEO_URL = "https://example.com/clip.mp4"
WAV = make_audio("wav", seconds=1.0)
BOUNDARY = "modalgate-test-boundary"


def form(fields: dict[str, str], file: bytes, filename: str = "clip.wav") -> bytes:
    """A multipart form as the openai SDK sends one: text fields, then ``file``."""
    lines = []
    for name, value in fields.items():
        lines += [f"--{BOUNDARY}", f'Content-Disposition: form-data; name="{name}"', "", value]
    head = "\r\n".join(
        [
            *lines,
            f"--{BOUNDARY}",
            f'Content-Disposition: form-data; name="file"; filename="{filename}"',
            "Content-Type: application/octet-stream",
            "",
            "",
        ]
    )
    return head.encode() + file + f"\r\n--{BOUNDARY}--\r\n".encode()


def _video_part() -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": VIDEO_URL}}


def _image_part(data: bytes = PNG) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def _base64_source(data: bytes) -> dict[str, str]:
    return {"type": "base64", "media_type": "image/png", "data": b64(data)}


def _chat_messages(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [part]}]


# kind -> (a body with the fault, its code, its param; a clean body with an image).
# The fault is a video for image-only kimi-k3 where the door can carry one (the chat door
# says unsupported_modality at the part's type), else a truncated PNG (invalid_image).
Case = tuple[dict[str, Any], str, str, dict[str, Any]]
CASES: dict[str, Case] = {
    "chat": (
        {"model": "kimi-k3", "messages": _chat_messages(_video_part())},
        "unsupported_modality",
        "messages.[0].content.[0].type",
        {"model": "kimi-k3", "messages": _chat_messages(_image_part())},
    ),
    "chat_batch": (
        {
            "model": "kimi-k3",
            "messages": [_chat_messages(_image_part()), _chat_messages(_video_part())],
        },
        "unsupported_modality",
        "messages.[1].[0].content.[0].type",
        {"model": "kimi-k3", "messages": [_chat_messages(_image_part())]},
    ),
    "responses": (
        {"model": "kimi-k3", "input": [{"role": "user", "content": [_video_part()]}]},
        "unsupported_modality",
        "input.[0].content.[0].type",
        {
            "model": "kimi-k3",
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG)}]}
            ],
        },
    ),
    "completions": (
        {"model": "kimi-k3", "prompt": "", "prompt_embeds": "AAAA"},
        "unsupported_modality",
        "prompt_embeds",
        {"model": "kimi-k3", "prompt": "a cat"},
    ),
    "messages": (
        {"model": "kimi-k3", "messages": _chat_messages(_video_part())},
        "unsupported_modality",
        "messages.[0].content.[0].type",
        {"model": "kimi-k3", "messages": _chat_messages(_image_part())},
    ),
    "pooling": (
        {"model": "kimi-k3", "messages": _chat_messages(_video_part())},
        "unsupported_modality",
        "messages.[0].content.[0].type",
        {"model": "kimi-k3", "messages": _chat_messages(_image_part())},
    ),
    "invocations": (
        {"model": "kimi-k3", "messages": _chat_messages(_video_part())},
        "unsupported_modality",
        "messages.[0].content.[0].type",
        {"model": "kimi-k3", "messages": _chat_messages(_image_part())},
    ),
    "generate": (
        {"model": "kimi-k3", "text": "hi", "video_data": VIDEO_URL},
        "unsupported_modality",
        "video_data",
        {"model": "kimi-k3", "text": "hi", "image_data": data_url(PNG)},
    ),
    "anthropic": (
        {
            "model": "kimi-k3",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": b64(CUT),
                            },
                        }
                    ],
                }
            ],
        },
        "invalid_image",
        "messages.[0].content.[0].source.data",
        {
            "model": "kimi-k3",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": b64(PNG),
                            },
                        },
                    ],
                }
            ],
        },
    ),
    "score": (
        {"model": "kimi-k3", "query": "a cat", "documents": [{"content": [_video_part()]}]},
        "unsupported_modality",
        "documents.[0].content.[0].type",
        {"model": "kimi-k3", "query": "a cat", "documents": ["text", {"content": [_image_part()]}]},
    ),
    "embed_v2": (
        {"model": "kimi-k3", "input_type": "image", "images": [data_url(CUT)]},
        "invalid_image",
        "images.[0]",
        {
            "model": "kimi-k3",
            "input_type": "image",
            "inputs": [{"content": [{"type": "text", "text": "a"}, _image_part()]}],
        },
    ),
    "token_in": (
        {
            "model": "kimi-k3",
            "token_ids": [1, 2, 3],
            "features": {
                "mm_hashes": {"video": ["h0"]},
                "mm_placeholders": {"video": [{"offset": 0, "length": 2}]},
                "kwargs_data": {"video": ["AAAA"]},
            },
        },
        "unsupported_modality",
        "features.mm_hashes.video.[0]",
        {
            "model": "kimi-k3",
            "token_ids": [1, 2, 3],
            "content_parts": [{"type": "image_url", "url": data_url(PNG)}],
        },
    ),
    "media_lists": (
        {"model": "kimi-k3", "state": "x", "questions": {}, "videos": [VIDEO_URL]},
        "unsupported_modality",
        "videos.[0]",
        {"model": "kimi-k3", "state": "x", "images": [data_url(PNG), {"url": data_url(PNG)}]},
    ),
    "ollama": (
        {"model": "kimi-k3", "messages": [{"role": "user", "content": "?", "images": [b64(CUT)]}]},
        "invalid_image",
        "messages.[0].images.[0]",
        {"model": "kimi-k3", "messages": [{"role": "user", "content": "?", "images": [b64(PNG)]}]},
    ),
    # A PNG uploaded as audio to an audio model (the chat door: an image in input_audio).
    "audio_upload": (
        {"form": form({"model": "Qwen/Qwen2-Audio-7B-Instruct"}, PNG, "clip.wav")},
        "modality_mismatch",
        "file",
        {"form": form({"model": "Qwen/Qwen2-Audio-7B-Instruct", "language": "en"}, WAV)},
    ),
    "vertex": (
        {"instances": [{"text": "hi"}], "parameters": {"video_data": VIDEO_URL}},
        "unsupported_modality",
        "parameters.video_data",
        {"instances": [{"text": "hi", "image_data": data_url(PNG)}]},
    ),
}


def judged_doors() -> list[tuple[str, str, str, str]]:
    """(engine, path, kind, method) for every judged door and method of both engines."""
    doors = []
    for engine in ("vllm", "sglang"):
        for door, spec in engine_doors()[engine].items():
            kind = kind_of(spec)
            if kind in UNJUDGED or door.endswith("/*"):
                continue
            methods = getattr(spec, "methods", ("POST",))
            doors += [(engine, door, kind, method) for method in methods]
    return doors


def test_every_judged_kind_has_a_case():
    assert {kind for _, _, kind, _ in judged_doors()} <= set(CASES)


class Recorder:
    """The engine's app as far as the gate can tell: every door answers what it received."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str, bytes]] = []

    def app(self, engine: str) -> Starlette:
        routes = [
            Route(door, self._door, methods=["GET", "POST", "PUT"])
            for door in engine_doors()[engine]
            if not door.endswith("/*")
        ]
        routes.append(Route("/not-a-door", self._door, methods=["POST"]))
        routes.append(Route("/closed", self._door, methods=["POST"]))
        routes.append(WebSocketRoute("/v1/realtime", self._realtime))
        routes.append(WebSocketRoute("/closed", self._realtime))
        return Starlette(routes=routes)

    async def _realtime(self, websocket: WebSocket) -> None:
        """Records each event it hears and answers it, until the client (or gate) closes."""
        await websocket.accept()
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.received.append(("WEBSOCKET", websocket.url.path, message["text"].encode()))
            await websocket.send_text("heard")

    async def _door(self, request: Request) -> JSONResponse:
        body = await request.body()
        self.received.append((request.method, request.url.path, body))
        return JSONResponse({"door": request.url.path})


@contextlib.contextmanager
def mounted(
    engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Recorder, str]]:
    """The recorder behind ``ModalGate(app)``, set up by the environment alone: the engine,
    and a policy file whose default model judges bodies that name none (Vertex's)."""
    policy = tmp_path_factory.mktemp("policy") / "policy.yaml"
    policy.write_text(
        "extends: builtin\ndefault_model: kimi-k3\nendpoints: {/closed: refuse}\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("MODALGATE_ENGINE", engine)
    monkeypatch.setenv("MODALGATE_POLICY", str(policy))
    recorder = Recorder()
    app = recorder.app(engine)
    app.add_middleware(ModalGate)  # what vLLM's --middleware modalgate.ModalGate does
    with serve(app) as base:
        yield recorder, base


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine_app(request, tmp_path_factory) -> Iterator[tuple[str, Recorder, str]]:
    engine = request.param
    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        mounted(engine, monkeypatch, tmp_path_factory) as (recorder, base),
    ):
        yield request.param, recorder, base


def sent(payload: dict[str, Any]) -> bytes:
    """The bytes a case sends: its form as built, or its JSON."""
    return payload["form"] if "form" in payload else orjson.dumps(payload)


def send_case(
    base: str, method: str, door: str, payload: dict[str, Any], key: str | None = None
) -> httpx.Response:
    if "form" in payload:
        content_type = f"multipart/form-data; boundary={BOUNDARY}"
    else:
        content_type = "application/json"
    headers = {"content-type": content_type}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.request(method, base + door, content=sent(payload), headers=headers, timeout=30)


def test_each_door_refuses_the_fault_as_the_chat_door_does(engine_app):
    engine, recorder, base = engine_app
    doors = [d for d in judged_doors() if d[0] == engine]
    assert len(doors) >= 10
    for _, door, kind, method in doors:
        fault, code, param, _ = CASES[kind]
        recorder.received.clear()
        answer = send_case(base, method, door, fault)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (400, code, param), (
            door,
            method,
            error,
        )
        assert recorder.received == [], door
        if kind == "anthropic":  # its own envelope, the code and param inside it
            assert answer.json()["type"] == "error"
            assert error["type"] == "invalid_request_error"


def test_each_door_passes_a_clean_body_unchanged(engine_app):
    engine, recorder, base = engine_app
    for _, door, kind, method in (d for d in judged_doors() if d[0] == engine):
        clean = CASES[kind][3]
        recorder.received.clear()
        answer = send_case(base, method, door, clean)
        assert answer.status_code == 200, (door, method, answer.text)
        assert recorder.received == [(method, door, sent(clean))], door


def test_a_door_the_policy_refuses_is_closed_to_bodies_and_websockets(engine_app):
    _, recorder, base = engine_app
    recorder.received.clear()
    answer = send_case(base, "POST", "/closed", CASES["chat"][3])
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "not_found")
    with pytest.raises(InvalidStatus) as refused:
        connect(base.replace("http", "ws") + "/closed")
    assert refused.value.response.status_code == 403
    assert recorder.received == []


def _pcm(seconds: float, rate: int) -> str:
    return b64(b"\x00\x01" * int(seconds * rate))


def test_realtime_refuses_a_model_that_takes_no_audio_at_the_handshake(engine_app):
    _, recorder, base = engine_app
    recorder.received.clear()
    with pytest.raises(InvalidStatus) as refused:
        connect(base.replace("http", "ws") + "/v1/realtime?model=kimi-k3")
    answer = refused.value.response
    error = orjson.loads(answer.body)["error"]
    assert (answer.status_code, error["code"], error["param"]) == (
        400,
        "unsupported_modality",
        "model",
    )
    assert recorder.received == []


@pytest.mark.parametrize(
    ("events", "code", "param"),
    [
        # The model named in the session, not the URL (vLLM's way).
        ([{"type": "session.update", "model": "kimi-k3"}], "unsupported_modality", "model"),
        # SGLang's and OpenAI's place for it.
        (
            [
                {
                    "type": "session.update",
                    "session": {"audio": {"input": {"transcription": {"model": "kimi-k3"}}}},
                }
            ],
            "unsupported_modality",
            "session.audio.input.transcription.model",
        ),
        (
            [{"type": "input_audio_buffer.append", "audio": "not base64!"}],
            "invalid_base64",
            "audio",
        ),
        # qwen2-audio: 30 s at most; 20 s, committed, then 20 s and 20 s more.
        (
            [
                {"type": "input_audio_buffer.append", "audio": "20s"},
                {"type": "input_audio_buffer.commit"},
                {"type": "input_audio_buffer.append", "audio": "20s"},
                {"type": "input_audio_buffer.append", "audio": "20s"},
            ],
            "media_too_large",
            "audio",
        ),
    ],
)
def test_realtime_judges_each_event_before_the_app_hears_it(engine_app, events, code, param):
    engine, recorder, base = engine_app
    rate = 16_000 if engine == "vllm" else 24_000
    recorder.received.clear()
    with connect(base.replace("http", "ws") + "/v1/realtime?model=qwen2-audio") as socket:
        answer: dict[str, Any] = {}
        for event in events:
            if event.get("audio") == "20s":
                event = {**event, "audio": _pcm(20, rate)}
            socket.send(orjson.dumps(event).decode())
            heard = socket.recv()
            if heard != "heard":
                answer = orjson.loads(heard)
                break
        error = answer["error"]
        assert (answer["type"], error["code"], error["param"]) == ("error", code, param)
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv()
        assert closed.value.rcvd.code == 1008
    # The app heard every event before the refused one, and not that one.
    assert len(recorder.received) == len(events) - 1


def test_an_upload_is_judged_by_its_bytes_and_its_form(engine_app):
    _, recorder, base = engine_app
    recorder.received.clear()
    door = "/v1/audio/transcriptions"
    cases = [
        # Audio to image-only kimi-k3: the rule's own message, at the file.
        (form({"model": "kimi-k3"}, WAV), "unsupported_modality", "file"),
        # Two files: Starlette keeps the last, so the gate refuses to pick one.
        (form({"model": "qwen2-audio", "file": "x"}, WAV), "invalid_request", "file"),
        # No file at all.
        (
            form({"model": "qwen2-audio"}, WAV).replace(b'name="file"', b'name="other"'),
            "invalid_request",
            "file",
        ),
    ]
    for body, code, param in cases:
        answer = send_case(base, "POST", door, {"form": body})
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (400, code, param), error
    not_a_form = httpx.post(
        base + door, content=b"{}", headers={"content-type": "application/json"}
    )
    assert not_a_form.json()["error"]["code"] == "invalid_request"
    assert recorder.received == []


def test_a_named_engine_refuses_a_body_on_a_path_it_does_not_list(engine_app):
    _, recorder, base = engine_app
    recorder.received.clear()
    answer = send_case(base, "POST", "/not-a-door", CASES["chat"][3])
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"
    assert recorder.received == []
    # The same path and body reach the app where no engine is named (the docs say why).


def test_no_engine_named_passes_other_paths_and_judges_every_engines_doors(monkeypatch):
    monkeypatch.delenv("MODALGATE_ENGINE", raising=False)
    monkeypatch.delenv("MODALGATE_POLICY", raising=False)
    recorder = Recorder()
    app = recorder.app("vllm")
    app.add_middleware(ModalGate)
    with serve(app) as base:
        fault, code, param, clean = CASES["anthropic"]
        refused = send_case(base, "POST", "/v1/messages", fault).json()
        assert (refused["type"], refused["error"]["code"], refused["error"]["param"]) == (
            "error",
            code,
            param,
        )
        assert send_case(base, "POST", "/not-a-door", clean).status_code == 200
        assert recorder.received == [("POST", "/not-a-door", orjson.dumps(clean))]


def test_the_gates_own_keys_from_the_environment_lock_the_doors(monkeypatch):
    """``MODALGATE_API_KEYS`` read by ``ModalGate(app)``: a body without a key is never
    read (401), with one it is judged."""
    monkeypatch.delenv("MODALGATE_POLICY", raising=False)
    monkeypatch.setenv("MODALGATE_ENGINE", "vllm")
    monkeypatch.setenv("MODALGATE_API_KEYS", "door-key")
    recorder = Recorder()
    app = recorder.app("vllm")
    app.add_middleware(ModalGate)
    fault, code, param, _ = CASES["score"]
    with serve(app) as base:
        for key in (None, "wrong"):
            answer = send_case(base, "POST", "/score", fault, key)
            assert (answer.status_code, answer.json()["error"]["code"]) == (401, "invalid_api_key")
        error = send_case(base, "POST", "/score", fault, "door-key").json()["error"]
        assert (error["code"], error["param"]) == (code, param)
    assert recorder.received == []
