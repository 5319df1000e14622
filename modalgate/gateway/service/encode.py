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

from typing import Any

import anyio
import anyio.to_thread
import pybase64
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from modalgate.encoder_adapter import EncoderAdapter, Overloaded
from modalgate.errors import ErrorCode, Violation, error_json, status_of
from modalgate.gateway.gate.middleware import get_verdict
from modalgate.gateway.gate.send import json_bytes
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
        unusable = [part for part in images if part.data is None]
        if unusable:
            param = unusable[0].payload_at
            return _error(
                Violation(
                    ErrorCode.INVALID_REQUEST,
                    f"{param}: only inline or fetched images can be encoded (not file ids)",
                    param,
                )
            )
        outcome = await _unless_disconnected(request.receive, adapter, images)
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
    receive: Receive, adapter: EncoderAdapter, images: list[MediaPart]
) -> list[Any] | Overloaded | None:
    """Encode, but give up (and leave the queue) the moment the client disconnects."""
    outcome: list[Any] | Overloaded | None = None

    async def encode() -> None:
        nonlocal outcome
        try:
            outcome = await adapter.encode([part.data or b"" for part in images])
        except Overloaded as exc:
            outcome = exc
        group.cancel_scope.cancel()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(encode)
        group.start_soon(watch)
    return outcome


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
