"""Between the gate and the proxies: pick the request's route, rewrite images if asked.

The route is the matched rule's own ``upstream``, else the default one. A rule
with ``embeds:`` has its accepted images encoded here and replaced by
``image_embeds`` parts, so the model server skips its own vision tower; every
other request goes upstream exactly as the gate passed it on.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio.to_thread
from starlette.types import Message, Receive, Scope, Send

from modalgate.encoder_adapter import EncoderAdapter, Overloaded
from modalgate.errors import ErrorCode, Violation, error_json
from modalgate.gateway.gate.middleware import get_verdict, with_content_length
from modalgate.gateway.gate.send import send_error, send_json
from modalgate.gateway.upstream.balancer import Upstreams
from modalgate.policy.models import EmbedsSpec, EndpointKind
from modalgate.policy.surface import CLOSED
from modalgate.validators import Verdict
from modalgate.validators.json_body import rewrite_json_body

_CLOSED = {None, *CLOSED}  # off the surface, an engine's admin path, or a refused door

AdapterLookup = Callable[[str | None], EncoderAdapter | None]


class Forwarder:
    def __init__(
        self,
        upstreams: Upstreams,
        adapter_for: AdapterLookup,
        endpoint_kind: Callable[[str], EndpointKind | None] = lambda _path: "forward",
    ) -> None:
        """``endpoint_kind``: the policy's API surface; a path off it is never forwarded."""
        self.upstreams = upstreams
        self.adapter_for = adapter_for
        self.endpoint_kind = endpoint_kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.endpoint_kind(scope["path"]) in _CLOSED:
            await send_error(send, [_not_forwarded(scope)])
            return
        verdict = get_verdict(scope) if scope["type"] == "http" else None
        route = self.upstreams.route_for(verdict.rule if verdict is not None else None)
        if route is None:
            await send_error(
                send, [_no_route(scope, verdict if self.upstreams.configured else None)]
            )
            return
        embeds = verdict.rule.embeds if verdict is not None and verdict.rule is not None else None
        images = verdict is not None and any(p.modality == "image" for p in verdict.parts)
        if verdict is None or embeds is None or not images:
            await route.dispatch(scope, receive, send)
            return
        if verdict.api == "responses":
            await send_error(send, [_no_embeds_in_responses(verdict)])
            return
        body = (await receive()).get("body", b"")  # the gate replays the body whole
        rewritten = await self._rewrite(verdict, embeds, body, send)
        if rewritten is None:
            return
        scope = dict(scope, headers=with_content_length(scope, len(rewritten)))
        await route.dispatch(scope, _body_then(rewritten, receive), send)

    async def _rewrite(
        self, verdict: Verdict, embeds: EmbedsSpec, body: bytes, send: Send
    ) -> bytes | None:
        """The body with image_embeds parts; None once an error has been sent."""
        from modalgate.gateway.service.embeds import rewrite_to_embeds

        assert verdict.rule is not None
        adapter = self.adapter_for(verdict.rule.encoder)
        if adapter is None:  # refused at start and on reload; kept as a guard
            violation = Violation(ErrorCode.ENCODER_ERROR, "no encoder serves this model here")
            await send_error(send, [violation])
            return None
        try:
            embedded = await rewrite_to_embeds(verdict, adapter, embeds)
        except Overloaded as exc:
            violation = Violation(
                ErrorCode.ENCODER_OVERLOADED, "the encoder is busy; retry shortly"
            )
            retry = str(int(exc.retry_after_s)).encode()
            await send_json(send, 503, error_json([violation]), [(b"retry-after", retry)])
            return None
        if embedded.violations:
            await send_error(send, embedded.violations)
            return None
        # The new parts go into the body as received; the rest of it stays as sent.
        return await anyio.to_thread.run_sync(rewrite_json_body, body, embedded.edits)


def _no_route(scope: Scope, verdict: Verdict | None) -> Violation:
    if verdict is not None:
        shown = (verdict.model or "")[:100]
        return Violation(
            ErrorCode.UNKNOWN_MODEL,
            f"model: no upstream serves {shown!r} here (no route for it and no default)",
            "model",
        )
    return Violation(
        ErrorCode.NOT_FOUND,
        f"no upstream serves {scope['path'][:100]!r} here (no default upstream)",
    )


def _not_forwarded(scope: Scope) -> Violation:
    return Violation(
        ErrorCode.NOT_FOUND,
        f"{scope['path'][:100]!r} is not forwarded here (not in the policy's endpoints,"
        " or an engine's admin path)",
    )


def _no_embeds_in_responses(verdict: Verdict) -> Violation:
    shown = (verdict.model or "")[:100]
    return Violation(
        ErrorCode.INVALID_REQUEST,
        f"input: images for {shown!r} are encoded here and sent on as image_embeds, which only "
        "the Chat Completions API carries; send this request to /v1/chat/completions",
        "input",
    )


def _body_then(body: bytes, receive: Receive) -> Receive:
    """The rewritten body first; then the real channel (for http.disconnect)."""
    sent = False

    async def next_message() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return next_message
