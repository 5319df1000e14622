"""The realtime websocket guarded in ASGI: the handshake refused for a model that takes no
audio, then every client event judged (``validators.realtime``) before the app reads it.

A refusal at the handshake is an HTTP answer in the error envelope where the server
offers the ``websocket.http.response`` extension (uvicorn does), else a plain close
(403). A refused event is answered with an ``error`` event in the same envelope (OpenAI's
realtime ``error`` with ``code`` and ``param``), the connection is closed (1008, policy
violation), and the app hears ``websocket.disconnect``: the refused audio never reaches it.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modalgate.errors import Violation, error_body, error_json, status_of
from modalgate.policy import RuleMatcher
from modalgate.validators.realtime import RealtimeSession

POLICY_VIOLATION = 1008


async def guard_realtime(
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    matcher: RuleMatcher,
    engine: str | None,
) -> None:
    session = _session(scope, matcher, engine)
    refusal = session.handshake_refusal()
    if refusal is not None:
        await _refuse_handshake(scope, receive, send, refusal)
        return
    closed = False

    async def judged() -> Message:
        nonlocal closed
        if closed:
            return {"type": "websocket.disconnect", "code": POLICY_VIOLATION}
        message = await receive()
        if message["type"] != "websocket.receive":
            return message
        frame = message.get("text") or message.get("bytes")
        violation = session.judge(frame) if frame else None
        if violation is None:
            return message
        closed = True
        event = {"type": "error", **error_body([violation])}
        await send({"type": "websocket.send", "text": orjson.dumps(event).decode()})
        await send({"type": "websocket.close", "code": POLICY_VIOLATION})
        return {"type": "websocket.disconnect", "code": POLICY_VIOLATION}

    await app(scope, judged, send)


def _session(scope: Scope, matcher: RuleMatcher, engine: str | None) -> RealtimeSession:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return RealtimeSession.opened(matcher, query.get("model", [None])[-1], engine)


def realtime_handshake_refusal(
    scope: Scope, matcher: RuleMatcher, engine: str | None
) -> Violation | None:
    """The handshake as an HTTP request (a ``GET`` with ``Upgrade: websocket``, as Envoy's
    ext_authz and ext_proc are asked about it): refused where the URL names a model that
    takes no audio. The frames that follow are not seen there: only a gate mounted in the
    engine's app judges them."""
    return _session(scope, matcher, engine).handshake_refusal()


async def _refuse_handshake(scope: Scope, receive: Receive, send: Send, refusal: Violation) -> None:
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        body = error_json([refusal])
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status_of([refusal]),
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": POLICY_VIOLATION})
