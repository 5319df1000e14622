"""``ApiKeyAuth``: the front door's lock; a request without a valid bearer key goes no further.

It sits before the gate, so an unauthenticated request never has its body read,
validated or forwarded: the answer is a 401 in OpenAI's envelope with code
``invalid_api_key`` (what OpenAI answers, so the SDK raises ``AuthenticationError``).
Every configured key is compared, in constant time, whatever the first comparisons
found: how long a refusal takes says nothing about which key came close.

The ``Authorization`` header is not removed: the upstream may check the same key,
and a gateway that stripped it would break that. Open paths (health, metrics) pass
without a key unless the operator asks otherwise.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from modalgate.errors import ErrorCode, Violation
from modalgate.gateway.gate.send import send_error

CHALLENGE = [(b"www-authenticate", b'Bearer realm="modalgate"')]
MISSING = Violation(
    ErrorCode.INVALID_API_KEY,
    "no API key: send one in the Authorization header as 'Bearer KEY'",
)
WRONG = Violation(ErrorCode.INVALID_API_KEY, "the API key is not valid")


class ApiKeyAuth:
    """Pure ASGI: refuses HTTP requests whose ``Authorization: Bearer`` key is not one of
    ``keys``; paths in ``open_paths`` pass as they are. No keys: everything passes."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        self.open_paths = frozenset(path.rstrip("/") for path in open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            not self.keys
            or scope["type"] not in ("http", "websocket")
            or scope["path"].rstrip("/") in self.open_paths
        ):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        if token is not None and self.accepts(token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await send_error(send, [MISSING if token is None else WRONG], CHALLENGE)

    def accepts(self, token: bytes) -> bool:
        matched = False
        for key in self.keys:  # every key, no early exit
            matched |= hmac.compare_digest(token, key)
        return matched


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key of the first ``Authorization: Bearer KEY`` header; None without one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


def read_key_file(path: str) -> list[str]:
    """Keys from a file, one a line; blank lines and ``#`` comments skipped (a mounted
    secret with its trailing newline reads as one key)."""
    lines = Path(path).read_text("utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def configured_keys(api_keys: Iterable[SecretStr], key_file: str | None) -> list[str]:
    """The keys of ``--api-key`` and ``--api-key-file`` together. A key file that holds no
    key is an error, not "no authentication": the operator asked for a lock."""
    keys = [key.get_secret_value() for key in api_keys]
    if key_file:
        from_file = read_key_file(key_file)
        if not from_file:
            raise ValueError(f"the API key file {key_file} holds no key")
        keys += from_file
    return keys
