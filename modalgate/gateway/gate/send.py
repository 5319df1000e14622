"""Sending modalgate's own JSON responses over raw ASGI."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from starlette.types import Send

from modalgate.errors import Violation, anthropic_error_json, error_json, status_of


async def send_json(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send,
    violations: Sequence[Violation],
    headers: Sequence[tuple[bytes, bytes]] = (),
    api: str | None = None,
) -> None:
    """The OpenAI envelope, or Anthropic's on its doors (``api``: how the path's body is
    read); always plain JSON, even for ``"stream": true`` requests."""
    body = anthropic_error_json(violations) if api == "anthropic" else error_json(violations)
    await send_json(send, status_of(violations), body, headers)


def json_bytes(value: object) -> bytes:
    return orjson.dumps(value)
