"""Between the gate and the proxy: the encoder-side rewrite, for rules that ask for it.

A rule with ``embeds:`` has its accepted images encoded here and replaced by
``image_embeds`` parts, so the model server skips its own vision tower; every
other request goes to the proxy exactly as the gate passed it on.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio.to_thread
import orjson
from starlette.types import Message, Receive, Scope, Send

from modalgate.encoder_adapter import EncoderAdapter, Overloaded
from modalgate.errors import ErrorCode, Violation, error_json
from modalgate.gateway.middleware import get_verdict
from modalgate.gateway.proxy import UpstreamProxy
from modalgate.gateway.responses import send_error, send_json

AdapterLookup = Callable[[str | None], EncoderAdapter | None]


class Forwarder:
    def __init__(self, proxy: UpstreamProxy, adapter_for: AdapterLookup) -> None:
        self.proxy = proxy
        self.adapter_for = adapter_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        verdict = get_verdict(scope) if scope["type"] == "http" else None
        embeds = verdict.rule.embeds if verdict is not None and verdict.rule is not None else None
        if verdict is None or embeds is None:
            await self.proxy(scope, receive, send)
            return
        from modalgate.gateway.embeds import rewrite_to_embeds

        adapter = self.adapter_for(verdict.rule.encoder)
        if adapter is None:  # refused at start and on reload; kept as a guard
            await send_error(
                send, [Violation(ErrorCode.ENCODER_ERROR, "no encoder serves this model here")]
            )
            return
        try:
            violations = await rewrite_to_embeds(verdict, adapter, embeds)
        except Overloaded as exc:
            violation = Violation(
                ErrorCode.ENCODER_OVERLOADED, "the encoder is busy; retry shortly"
            )
            await send_json(
                send,
                503,
                error_json([violation]),
                [(b"retry-after", str(int(exc.retry_after_s)).encode())],
            )
            return
        if violations:
            await send_error(send, violations)
            return
        body = await anyio.to_thread.run_sync(orjson.dumps, verdict.request)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.proxy(dict(scope, headers=headers), _body_then(body, receive), send)


def _body_then(body: bytes, receive: Receive) -> Receive:
    """The rewritten body first; then the real channel (for http.disconnect)."""
    sent = False

    async def next_message() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        await receive()  # the original body, replayed by the gate: consumed, not forwarded
        return {"type": "http.request", "body": body, "more_body": False}

    return next_message
