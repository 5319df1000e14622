"""The gate's short ways give what its long ways give.

A gated path spelled in normal form, with its raw_path the same (or none), is
routed by one lookup; an accepted text-only body is validated inline and forwarded
with no other await; a short Content-Length is taken without ``int``. Each is held
here to the behaviour of the way around it: other spellings, enforced paths,
observers, and Content-Length values the short test does not settle.
"""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest

from conftest import chat
from modalgate import ModalGate, get_verdict
from modalgate.gateway.gate.outcome import GateOutcome
from modalgate.gateway.gate.paths import is_normal

TEXT = orjson.dumps(chat(model="kimi-k3"))
VIDEO = orjson.dumps(
    chat({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, model="kimi-k3")
)
# Refused by kimi-k3 (images only), and shadowable: no URL to fetch.
AUDIO = orjson.dumps(
    chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, model="kimi-k3")
)
_ABSENT = object()


class App:
    """Records what reached it; answers 204."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        self.scopes.append(scope)
        self.bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def post(
    gate: ModalGate,
    body: bytes,
    path: str = "/v1/chat/completions",
    raw_path: object = _ABSENT,
    length: bytes | None = None,
    pieces: int = 1,
) -> tuple[int, dict[str, Any]]:
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", length if length is not None else b"%d" % len(body)),
        ],
        "query_string": b"",
    }
    if raw_path is not _ABSENT:
        scope["raw_path"] = raw_path
    sent: list[dict[str, Any]] = []
    step = -(-len(body) // pieces)
    messages = [
        {"type": "http.request", "body": body[i : i + step], "more_body": i + step < len(body)}
        for i in range(0, len(body), step)
    ]
    messages.append({"type": "http.disconnect"})

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    anyio.run(gate, scope, receive, send)
    answer = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], orjson.loads(answer) if answer else {}


@pytest.mark.parametrize(
    ("path", "raw_path", "forwarded_raw"),
    [
        ("/v1/chat/completions", b"/v1/chat/completions", b"/v1/chat/completions"),
        ("/v1/chat/completions", _ABSENT, _ABSENT),
        ("/v1/chat/completions", None, None),
        ("/v1/chat/completions", b"/v1/chat%2Fcompletions", b"/v1/chat/completions"),
        ("/v1/chat/completions", b"/v1/chat/completions%00", b"/v1/chat/completions"),
        ("/v1//chat/completions", b"/v1//chat/completions", b"/v1/chat/completions"),
        ("/v1/x/../chat/completions", b"/v1/x/../chat/completions", b"/v1/chat/completions"),
        ("/v1/chat/completions/", b"/v1/chat/completions/", b"/v1/chat/completions/"),
        ("/chat/completions", b"/chat/completions", b"/chat/completions"),
    ],
)
def test_every_spelling_of_a_gated_path_is_judged(path, raw_path, forwarded_raw):
    app = App()
    gate = ModalGate(app, policy=None)
    status, error = post(gate, VIDEO, path, raw_path)
    assert (status, error["error"]["code"]) == (400, "unsupported_modality")
    status, _ = post(gate, TEXT, path, raw_path)
    assert status == 204
    [scope] = app.scopes
    assert scope.get("raw_path", _ABSENT) == forwarded_raw
    assert app.bodies == [TEXT]
    verdict = get_verdict(scope)
    assert verdict is not None and verdict.accepted and verdict.model == "kimi-k3"


def test_only_given_paths_spelled_normally_take_the_one_lookup():
    assert is_normal("/v1/chat/completions") and is_normal("/")
    for odd in ("/v1//x", "/v1/./x", "/v1/../x", "/a%2Fb", "/a b", "/caf\u00e9", "/.hidden/x"):
        assert not is_normal(odd)
    gate = ModalGate(App(), policy=None, paths=["/v1/chat/completions", "/v1//odd", "/a b"])
    assert set(gate._routes) == {"/v1/chat/completions", "/v1/responses", "/responses"}


def test_an_enforced_path_enforces_and_the_others_shadow():
    app = App()
    gate = ModalGate(app, policy=None, enforce=False, enforced_paths=["/v1/chat/completions"])
    status, error = post(gate, AUDIO, "/v1/chat/completions")
    assert (status, error["error"]["code"]) == (400, "unsupported_modality")
    status, _ = post(gate, AUDIO, "/chat/completions")
    assert status == 204  # shadowed: forwarded, the refusal reported
    assert app.bodies == [AUDIO]
    status, _ = post(gate, AUDIO, "/v1/chat/completions", b"/v1/chat%2Fcompletions")
    assert status == 400


def test_the_observer_hears_of_accepted_and_refused_requests():
    outcomes: list[GateOutcome] = []
    gate = ModalGate(App(), policy=None, on_outcome=outcomes.append)
    post(gate, TEXT)
    post(gate, VIDEO)
    post(gate, TEXT, length=b"nope")
    accepted, refused, early = outcomes
    assert accepted.accepted and accepted.rule == "kimi-k3" and accepted.seconds > 0
    assert accepted.body_bytes == len(TEXT) and accepted.path == "/v1/chat/completions"
    assert not refused.accepted and refused.code == "unsupported_modality"
    assert not early.accepted and early.code == "invalid_request" and early.body_bytes == 0


@pytest.mark.parametrize(
    ("length", "status"),
    [
        (None, 204),  # the body's own length: a few digits, under the cap unread
        (b"0000000000000000000000000000000000308", 204),  # many digits, a small number
        (b" 308 ", 204),  # int() takes the spaces, as it always did
        (b"99999999999999999999", 413),
        (b"", 400),
        (b"3o8", 400),
        (b"-1", 204),  # a number, not over the cap: the body is then read and counted
    ],
)
def test_content_length(length, status):
    got, _ = post(ModalGate(App(), policy=None), TEXT, length=length)
    assert got == status


@pytest.mark.parametrize("pieces", [1, 2, 7])
@pytest.mark.parametrize("body", [TEXT, AUDIO], ids=["accepted", "shadowed"])
def test_a_body_in_pieces_reaches_the_app_whole_in_one_message(pieces, body):
    seen: list[dict[str, Any]] = []

    async def app(scope, receive, send) -> None:
        seen.append(await receive())
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gate = ModalGate(app, policy=None, enforce=False)
    status, _ = post(gate, body, pieces=pieces)
    assert status == 204
    assert seen == [
        {"type": "http.request", "body": body, "more_body": False},
        {"type": "http.disconnect"},
    ]
