"""One request and its answer on an HTTP/1.1 connection: the ASGI ``receive`` and ``send``
that ``connection.Http11Protocol`` hands the app.

modalgate owns this rather than borrowing uvicorn's private ``RequestResponseCycle``,
which ``modalgate serve`` used to reach into (its ``body`` replaced, its fields read)
and so had to pin uvicorn to one minor version. The shape follows uvicorn's
(BSD-3-Clause): a body kept as the chunks received and joined once when the app asks
(none copied for a body read in one piece), the answer's head written when
``http.response.start`` comes, its framing (Content-Length or chunked) checked
against what the app sends.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message

# A request body handed over in parts (chunked, or longer than the whole-body size):
# reading pauses once this much waits unread by the app.
HIGH_WATER_BYTES = 64 * 1024

# RFC 9110's token characters only in a name; no control characters but tab in a value.
_BAD_HEADER_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")

logger = logging.getLogger("modalgate.protocol")


def _status_line(status: int) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


class FlowControl:
    """Reading paused and resumed on the transport, and writing's pause as the transport
    reports it (``drain`` waits it out)."""

    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()


class RequestCycle:
    """The app's view of one request: its body as it comes, its answer as it goes.

    ``whole``: the body is handed over once it is all in (the protocol sets
    ``more_body`` False then), not part by part."""

    def __init__(
        self,
        scope: dict[str, Any],
        transport: asyncio.Transport,
        flow: FlowControl,
        default_headers: list[tuple[bytes, bytes]],
        expect_100_continue: bool,
        keep_alive: bool,
        on_response: Callable[[], None],
    ) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.message_event = asyncio.Event()
        self.on_response = on_response
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body_chunks: list[bytes] = []
        self.body_size = 0
        self.whole = False
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self._chunked: bool | None = None
        self._length_left = 0

    def add_body(self, data: bytes) -> None:
        self.body_chunks.append(data)
        self.body_size += len(data)

    async def run_asgi(self, app: ASGIApp) -> None:
        """The app on this request; what it fails to answer is answered 500 (its error
        goes to the log, never to the client)."""
        try:
            result = await app(self.scope, self.receive, self.send)  # type: ignore[func-returns-value]
        except BaseException as exc:
            logger.error("Exception in ASGI application", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if result is not None:
                logger.error("ASGI callable returned %r, not None", result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting a response")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing its response")
                self.transport.close()
        finally:
            self.on_response = _nothing

    async def _send_500(self) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"21"),
            (b"connection", b"close"),
        ]
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def send(self, message: Message) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            head = self._head(message["status"], message.get("headers", ()))
            self.response_started = True
            self.waiting_for_100_continue = False
            self.transport.write(head)
            return
        if self.response_complete:
            raise RuntimeError(f"{kind!r} sent after the response was complete")
        if kind != "http.response.body":
            raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            self._length_left = 0
        elif self._chunked:
            chunk = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            self.transport.write(chunk if more_body else chunk + b"0\r\n\r\n")
        else:
            if len(body) > self._length_left:
                raise RuntimeError("response body longer than its Content-Length")
            self._length_left -= len(body)
            self.transport.write(body)
        if more_body:
            return
        if self._length_left != 0:
            raise RuntimeError("response body shorter than its Content-Length")
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _head(self, status: int, app_headers: Any) -> bytes:
        """The status line and headers; the framing the body will follow is noted. Checked
        before anything is written, so a bad header from the app is still a 500."""
        lines = [STATUS_LINES.get(status) or _status_line(status)]
        closes = False
        for name, value in (*self.default_headers, *app_headers):
            if _BAD_HEADER_NAME.search(name):
                raise RuntimeError(f"invalid response header name {name!r}")
            if _BAD_HEADER_VALUE.search(value):
                raise RuntimeError(f"invalid value of response header {name!r}")
            name = name.lower()
            if name == b"content-length" and self._chunked is None:
                self._length_left = int(value)
                self._chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self._length_left = 0
                self._chunked = True
            elif name == b"connection" and b"close" in _tokens(value):
                self.keep_alive = False
                closes = True
            lines.append(b"%b: %b\r\n" % (name, value))
        if not self.keep_alive and not closes:
            lines.append(b"connection: close\r\n")
        if self._chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self._chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        chunks = self.body_chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.body_chunks = []
        self.body_size = 0
        return {"type": "http.request", "body": body, "more_body": self.more_body}


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip().lower() for token in value.split(b",")]


def _nothing() -> None:
    return None
