"""``RequestId``: one id per request, from the client's header or made here, everywhere.

The id is the thread that ties a client's report to our logs and to the model
server's: it goes into the request headers the app sees (so the proxy forwards
the same id upstream), into ``scope["state"]``, into ``request_id_var`` for
every log line written while the request runs, and onto the response. A client
id is honoured only if it is short and plain, since it lands in logs and in the
upstream's headers; anything else is replaced, not repaired.

Pure ASGI, in the manner of asgi-correlation-id: messages pass through one by
one, so streamed responses are never buffered.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modalgate.gateway.http.protocol import ANSWERED_BY_SERVER
from modalgate.gateway.observability.logs import request_id_var

STATE_KEY = "request_id"
_SAFE_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

access_logger = logging.getLogger("modalgate.access")


def is_safe_id(value: str) -> bool:
    """1..128 characters that need no quoting in a header, a log line or a URL path."""
    return _SAFE_ID.fullmatch(value) is not None


# Ids need to be unique, not secret: a generator seeded from os.urandom (again in a
# forked child) makes them without a system call, which on a busy gateway is a wait
# for the GIL behind the thread validating a big body.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)
_random_bits = _ids.getrandbits


def new_id() -> str:
    """32 hex digits, as ``uuid4().hex`` has, without a UUID object or a system call."""
    return _random_bits(128).to_bytes(16, "big").hex()


class RequestId:
    def __init__(
        self,
        app: ASGIApp,
        header_name: str = "x-request-id",
        access_log: bool = True,
        generator: Callable[[], str] = new_id,
        validator: Callable[[str], bool] = is_safe_id,
    ) -> None:
        self.app = app
        self.header = header_name.lower().encode("latin-1")
        self.access_log = access_log
        self.generator = generator
        self.validator = validator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        incoming: str | None = None
        headers: list[tuple[bytes, bytes]] = []
        for name, value in scope["headers"]:
            if name.lower() == self.header:
                incoming = value.decode("latin-1") if incoming is None else incoming
            else:
                headers.append((name, value))
        request_id = incoming if incoming is not None and self.validator(incoming) else None
        if request_id is None:
            request_id = self.generator()
        raw_id = request_id.encode("latin-1")
        headers.append((self.header, raw_id))  # one value: the one the app and upstream see
        scope = dict(scope, headers=headers)
        scope.setdefault("state", {})[STATE_KEY] = request_id
        await _LoggedExchange(self, scope, request_id, raw_id)(receive, send)


class _LoggedExchange:
    """One request's state: its id, the status sent, the clock."""

    def __init__(self, owner: RequestId, scope: Scope, request_id: str, raw_id: bytes) -> None:
        self.owner = owner
        self.scope = scope
        self.request_id = request_id
        self.raw_id = raw_id
        self.status: int | None = None

    async def __call__(self, receive: Receive, send: Send) -> None:
        token = request_id_var.set(self.request_id)
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                self.status = message["status"]
                message = {**message, "headers": self._headers(message)}
            elif kind == "websocket.accept":
                self.status = 101
                message = {**message, "headers": self._headers(message)}
            elif kind == "websocket.close" and self.status is None:
                self.status = 403  # closed before accepting: the server answers 403
            await send(message)

        try:
            await self.owner.app(self.scope, receive, send_with_id)
        except BaseException as exc:
            # The id stays set: the server's own "Exception in ASGI application"
            # line, written in this task's context, then carries it too.
            self._log(started, type(exc).__name__)
            raise
        self._log(started, None)
        request_id_var.reset(token)

    def _headers(self, message: Message) -> list[tuple[bytes, bytes]]:
        # Replace whatever id the app set: a response carries exactly one.
        header = self.owner.header
        headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != header]
        headers.append((header, self.raw_id))
        return headers

    def _unanswered(self, exc_type: str | None) -> int:
        """The status of a request the app sent no response for."""
        if exc_type is not None:
            return 500  # the app raised: the server answers 500
        # The app returned quietly: the client went away first (nginx's 499), or the
        # server answered in its place (serve's protocol: a silent client's 408).
        return self.scope.get("extensions", {}).get(ANSWERED_BY_SERVER, 499)

    def _log(self, started: float, exc_type: str | None) -> None:
        if not self.owner.access_log or not access_logger.isEnabledFor(logging.INFO):
            return
        scope = self.scope
        fields: dict[str, object] = {
            "method": scope.get("method", "WEBSOCKET"),
            "path": scope.get("path", ""),
            "status": self.status if self.status is not None else self._unanswered(exc_type),
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            "request_id": self.request_id,
        }
        if exc_type is not None:
            fields["exc_type"] = exc_type
        access_logger.info("access", extra={"fields": fields})
