"""``POST /v1/encode``: the gateway as the encoder server of an Encode/Prefill/Decode split.

The body is a chat-completions request; ModalGate has validated it (a video
to kimi-k3 never gets here) and, for remote images, fetched the bytes. This
endpoint hands the image bytes to the encoder adapter and answers with one
embedding per image, as raw little-endian float32 in base64 (no JSON floats:
a 4k-token image would otherwise cost megabytes of digits). An embedding names its
image where an error on that image would: the param of its URL or data URL
(``messages.[0].content.[1].image_url.url``), as every check of an image's bytes does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import pybase64
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from modalgate.encoder_adapter import EncoderAdapter, Overloaded
from modalgate.errors import ErrorCode, Violation, error_json, status_of
from modalgate.gateway.gate.middleware import get_verdict
from modalgate.gateway.gate.send import json_bytes
from modalgate.gateway.http.protocol import ON_CLIENT_GONE
from modalgate.gateway.service.embeds import image_bytes
from modalgate.validators import MediaPart, Verdict

ENCODE_PATH = "/v1/encode"


def encode_endpoint(default: EncoderAdapter | None, by_spec: dict[str, EncoderAdapter]):
    """The endpoint; a rule's ``encoder:`` picks its adapter, else ``default`` serves."""

    async def endpoint(request: Request) -> Response:
        verdict = get_verdict(request.scope)
        if verdict is None:  # served without its gate: a wiring mistake, not the client's
            return Response(status_code=500)
        spec = verdict.rule.encoder if verdict.rule is not None else None
        adapter = by_spec.get(spec, default) if spec else default
        if adapter is None:
            shown = (verdict.model or "")[:100]
            return _error(
                Violation(
                    ErrorCode.INVALID_REQUEST, f"model: no encoder serves {shown!r} here", "model"
                )
            )
        images = [part for part in verdict.parts if part.modality == "image"]
        unusable = [part for part in images if not part.has_content]
        if unusable:
            param = unusable[0].payload_at
            return _error(
                Violation(
                    ErrorCode.INVALID_REQUEST,
                    f"{param}: only inline or fetched images can be encoded (not file ids)",
                    param,
                )
            )
        outcome = await _unless_disconnected(request.scope, request.receive, adapter, images)
        if outcome is None:
            return Response(status_code=499)  # nobody is listening any more
        if isinstance(outcome, Overloaded):
            retry = str(int(outcome.retry_after_s))
            return _error(
                Violation(ErrorCode.ENCODER_OVERLOADED, "the encoder is busy; retry shortly"),
                headers={"retry-after": retry},
            )
        violations = [
            _with_param(result.error, part)
            for part, result in zip(images, outcome, strict=True)
            if result.error is not None
        ]
        if violations:
            return _error(*violations)
        # Embeddings run to megabytes: serialising them is work for a thread, not the loop.
        body = await anyio.to_thread.run_sync(_body, verdict, images, outcome)
        return Response(body, media_type="application/json")

    return endpoint


async def _unless_disconnected(
    scope: Scope, receive: Receive, adapter: EncoderAdapter, images: list[MediaPart]
) -> list[Any] | Overloaded | None:
    """Encode, but give up (and leave the queue) the moment the client disconnects.

    Plain asyncio, as the proxy's exchange: an anyio task group here left its
    cancellation's traceback in a reference cycle with the request's verdict and image
    bytes (~100 objects a request, held until the garbage collector ran).
    """
    encoding = asyncio.ensure_future(adapter.encode(await image_bytes(images)))
    gone = False

    def client_left() -> None:
        nonlocal gone
        gone = True
        encoding.cancel()

    call_when_gone = scope.get("extensions", {}).get(ON_CLIENT_GONE)
    if call_when_gone is not None:  # modalgate serve's protocol tells us, no task needed
        forget = call_when_gone(client_left)
    else:
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive, client_left))
        forget = watcher.cancel
    try:
        return await encoding
    except Overloaded as exc:
        return exc
    except asyncio.CancelledError:
        if gone and not _being_cancelled():
            return None
        raise  # the server's (shutting down): the encode was cancelled with us
    finally:
        forget()


async def _wait_for_disconnect(receive: Receive, client_left: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    client_left()


def _being_cancelled() -> bool:
    """Whether this task is being cancelled itself, not only the encode it waits on
    (3.11+; on 3.10 a cancelled encode is taken for the client's going)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is not None and cancelling() > 0


def _with_param(violation: Violation, part: MediaPart) -> Violation:
    param = part.payload_at
    return Violation(violation.code, f"{param}: {violation.message}", param)


def _error(*violations: Violation, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_json(violations),
        status_code=status_of(violations),
        media_type="application/json",
        headers=headers,
    )


def _body(verdict: Verdict, images: list[MediaPart], results: list[Any]) -> bytes:
    data = []
    for index, (part, result) in enumerate(zip(images, results, strict=True)):
        tensor = result.embedding.float().contiguous()
        tokens, hidden = tensor.shape
        raw = tensor.numpy().astype("<f4", copy=False).tobytes()
        data.append(
            {
                "object": "image_embedding",
                "index": index,
                "param": part.payload_at,  # what an error on this image names too
                "grid_thw": list(result.grid_thw),
                "tokens": tokens,
                "shape": [tokens, hidden],
                "dtype": "float32",
                "cached": result.cached,
                "embedding": pybase64.b64encode(raw).decode("ascii"),
            }
        )
    return json_bytes({"object": "list", "model": verdict.model, "data": data})
