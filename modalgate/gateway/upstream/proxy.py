"""The reverse proxy to one model server: one connection pool, bodies streamed both ways.

Invisible when requests are clean: the request body goes upstream as it
arrives (or as the gate rewrote it), the response comes back chunk by chunk as
the upstream writes it (SSE included, raw bytes, no decompression), and every
header but the hop-by-hop ones passes both ways. The proxy speaks only for
itself: a refused connection is a 502 ``upstream_unavailable``, a timeout a 504
``upstream_timeout``; an upstream's own 4xx/5xx passes through untouched.
When the client goes away, the upstream request is closed with it, so the
model server stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import orjson
from starlette.types import Message, Receive, Scope, Send

from modalgate.errors import ErrorCode, Violation, error_body
from modalgate.gateway.gate.send import send_error
from modalgate.gateway.http.protocol import ON_CLIENT_GONE
from modalgate.gateway.upstream.pool import UpstreamPool, UpstreamResponse

logger = logging.getLogger("modalgate.proxy")

# RFC 9110 section 7.6.1, plus the de-facto ones proxies drop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers the proxy sets itself: Host is the upstream's.
_REPLACED_REQUEST = frozenset({b"host"})
_BODY_FRAMING = frozenset({b"content-length", b"transfer-encoding"})

# (seconds to the response's start, status or None, error code or None, route name)
UpstreamObserver = Callable[[float, "int | None", "str | None", str], None]


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    connect_timeout_s: float = 5.0
    # Between two reads, not in total: a long generation streams for minutes.
    read_timeout_s: float = 300.0
    write_timeout_s: float = 60.0  # each chunk of the request body
    max_connections: int = 512


class UpstreamProxy:
    """A pure ASGI app that forwards every HTTP request to ``base_url``."""

    def __init__(
        self,
        base_url: str,
        settings: UpstreamSettings | None = None,
        *,
        on_upstream: UpstreamObserver | None = None,
        on_response_end: Callable[[float, str], None] | None = None,
        transport: UpstreamPool | None = None,
    ) -> None:
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream must be an http(s) URL, not {base_url!r}")
        self.base_url = url
        self.settings = settings = settings or UpstreamSettings()
        self.on_upstream = on_upstream
        self.on_response_end = on_response_end
        self._prefix = url.raw_path.split(b"?", 1)[0].rstrip(b"/")
        self._host = url.netloc
        self.timeouts = httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.write_timeout_s,
            pool=settings.connect_timeout_s,
        ).as_dict()
        # No client object on top: a client keeps cookies from one user's response and
        # sends them with the next user's request, follows redirects, reads proxy
        # variables. A proxy wants none of that: requests go straight to the pool.
        self.transport = transport or UpstreamPool(url, settings.max_connections)

    async def get(self, path: str, timeout_s: float) -> httpx.Response:
        """A small GET of the proxy's own (health probes, model lists), body read."""
        url = self.base_url.copy_with(raw_path=self._prefix + path.encode())
        timeout = httpx.Timeout(timeout_s).as_dict()
        request = httpx.Request("GET", url, extensions={"timeout": timeout})
        with anyio.fail_after(timeout_s):
            response = await self.transport.handle_async_request(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.exchange(scope, receive, send)

    async def exchange(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        route: str = "default",
        fail_over: bool = False,
    ) -> bool:
        """One request and its response with this upstream; False (and nothing sent) when
        ``fail_over`` is set and the upstream could not be reached: the request never
        left, so another may take it."""
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return True
        return await _Exchange(self, scope, receive, send, route).run(fail_over)

    def target_of(self, scope: Scope) -> bytes:
        raw_path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        return self._prefix + raw_path.split(b"?", 1)[0] + (b"?" + query if query else b"")

    def headers_for(self, scope: Scope) -> tuple[list[tuple[bytes, bytes]], bool]:
        """The upstream request's headers, and whether a body follows."""
        headers = forwarded_headers(scope)
        headers.append((b"host", self._host))
        # The framing on our hop is the pool's: the client's length, or chunked.
        has_body = any(n in _BODY_FRAMING for n, _ in scope["headers"])
        return headers, has_body


class ClientGone(Exception):
    """The client disconnected while its request body was still being forwarded."""


class _Exchange:
    """One request and its response, in the manner of Starlette's GZip responder.

    From the moment the request body has been read until the last byte is out, the
    client's disconnect cancels this exchange, so an abandoned request is closed
    upstream whether the server is still thinking (no headers yet) or streaming. Under
    ``modalgate serve`` the server's protocol calls back (``ON_CLIENT_GONE``); under
    other servers a watcher task waits on ``receive`` for ``http.disconnect``. Plain
    asyncio, not a task group: the upstream client is an asyncio Protocol (pool.py), so
    the loop is asyncio's anyway, and this runs once per request.
    """

    def __init__(
        self, proxy: UpstreamProxy, scope: Scope, receive: Receive, send: Send, route: str
    ) -> None:
        self.proxy = proxy
        self.route = route
        self.scope = scope
        self.receive = receive
        self.send = send
        self.started = time.perf_counter()
        self.client_gone = False
        self.finished = False  # the last byte is out: a disconnect now is the normal end
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None  # forgets the serve protocol's callback
        self._watcher_cancelled = False

    async def run(self, fail_over: bool) -> bool:
        self._task = asyncio.current_task()
        try:
            return await self._exchange(fail_over)
        except ClientGone:
            self.client_gone = True
        except asyncio.CancelledError:
            if not self._watcher_cancelled or _take_back_cancel(self._task):
                raise  # not ours, or someone else's too
        finally:
            # Dropped, not only cancelled or called: each leads back to this exchange (the
            # callback is a bound method of ours), and the cycle would leave the request's
            # objects to the garbage collector instead of freeing them now.
            self._task = None
            if self._watcher is not None:
                self._watcher.cancel()
                self._watcher = None
            if self._unwatch is not None:
                self._unwatch()
                self._unwatch = None
        logger.info("client disconnected; upstream request closed")
        return True

    def _watch_for_disconnect(self) -> None:
        if self._watcher is not None or self._unwatch is not None:
            return
        call_when_gone = self.scope.get("extensions", {}).get(ON_CLIENT_GONE)
        if call_when_gone is not None:  # modalgate serve's protocol tells us, no task needed
            self._unwatch = call_when_gone(self._client_left)
        else:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self._client_left()

    def _client_left(self) -> None:
        if not self.finished and self._task is not None:
            self.client_gone = self._watcher_cancelled = True
            self._task.cancel()

    async def _content(self) -> bytes | AsyncIterator[bytes]:
        """The request body: bytes when it came whole in one message (one the gate read,
        one serve's protocol held, any small one; pool.py sends it without a stream),
        else a stream."""
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk and not message.get("more_body", False):
            self._watch_for_disconnect()
            return chunk
        return self._body(message)

    async def _body(self, message: Message) -> AsyncIterator[bytes]:
        while True:
            if message["type"] == "http.disconnect":
                self.client_gone = True  # raised through the pool's request() to us
                raise ClientGone
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                self._watch_for_disconnect()
                return
            message = await self.receive()

    async def _exchange(self, fail_over: bool) -> bool:
        headers, has_body = self.proxy.headers_for(self.scope)
        content = await self._content() if has_body else None
        if not has_body:
            self._watch_for_disconnect()
        try:
            response = await self.proxy.transport.request(
                self.scope["method"].encode(),
                self.proxy.target_of(self.scope),
                headers,
                content,
                self.proxy.timeouts,
            )
        except httpx.HTTPError as exc:
            if self.client_gone:
                raise ClientGone from exc
            violation = _violation(exc, self.proxy.settings)
            self._observe(None, violation.code.value)
            if fail_over and isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                return False
            self.finished = True
            await send_error(self.send, [violation])
            return True
        self._observe(response.status, None)
        try:
            await self._relay(response)
        finally:
            await response.aclose()
            if self.proxy.on_response_end is not None:
                self.proxy.on_response_end(time.perf_counter() - self.started, self.route)
        return True

    async def _relay(self, response: UpstreamResponse) -> None:
        headers = _response_headers(response.headers)
        await self.send(
            {"type": "http.response.start", "status": response.status, "headers": headers}
        )
        length = next((int(v) for n, v in headers if n == b"content-length" and v.isdigit()), None)
        remaining = length if length is not None else -1
        tail = b"\n\n"
        try:
            async for chunk in response.iter_chunks():
                if not chunk:
                    continue
                tail = chunk[-2:]
                remaining -= len(chunk)
                if remaining == 0:  # the declared length is complete: one send, not two
                    self.finished = True
                    await self.send({"type": "http.response.body", "body": chunk})
                    continue  # read on to the end of the message, so the connection is reused
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            violation = _violation(exc, self.proxy.settings, started=True)
            self._observe(response.status, violation.code.value)
            logger.warning("upstream failed mid-response: %s", violation.message)
            if not _is_event_stream(headers):
                return  # no final body message: the server aborts the response, as it should
            # SSE: tell the client in the stream, as vLLM does for its own mid-stream errors.
            event = b"data: " + orjson.dumps(error_body([violation])) + b"\n\n"
            prefix = b"" if tail.endswith(b"\n\n") else b"\n\n"  # finish a cut-off event
            self.finished = True
            await self.send({"type": "http.response.body", "body": prefix + event})
            return
        if not self.finished:
            self.finished = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def _observe(self, status: int | None, code: str | None) -> None:
        if self.proxy.on_upstream is not None:
            self.proxy.on_upstream(time.perf_counter() - self.started, status, code, self.route)


def _take_back_cancel(task: asyncio.Task[Any] | None) -> bool:
    """Withdraw the watcher's cancel request (3.11+); True if another one is pending."""
    uncancel = getattr(task, "uncancel", None)
    return uncancel is not None and uncancel() > 0


def forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's headers minus hop-by-hop ones, plus X-Forwarded-*.

    One pass over the headers (this runs on every request); the headers a
    ``Connection`` header names are dropped after it, in the rare request that has one.
    """
    kept: list[tuple[bytes, bytes]] = []
    forwarded_for: list[bytes] = []
    connection: list[bytes] = []
    host: bytes | None = None
    for item in scope["headers"]:
        name = item[0]
        if name in HOP_BY_HOP:
            if name == b"connection":
                connection.append(item[1])
            continue
        if name in _REPLACED_REQUEST:
            if host is None:
                host = item[1]
            continue
        if name == b"x-forwarded-for":
            forwarded_for.append(item[1])
        kept.append(item)
    if connection:
        named = {token.strip().lower() for value in connection for token in value.split(b",")}
        kept = [item for item in kept if item[0] not in named]
    client = scope.get("client")
    if client:
        if forwarded_for:
            kept = [item for item in kept if item[0] != b"x-forwarded-for"]
        kept.append((b"x-forwarded-for", b", ".join([*forwarded_for, client[0].encode()])))
    names = {item[0] for item in kept}
    if host is not None and b"x-forwarded-host" not in names:
        kept.append((b"x-forwarded-host", host))
    if b"x-forwarded-proto" not in names:
        kept.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
    return kept


def _response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    lowered = [(name.lower(), value) for name, value in raw]
    connection_named = {
        token.strip().lower()
        for name, value in lowered
        if name == b"connection"
        for token in value.split(b",")
    }
    return [
        (name, value)
        for name, value in lowered
        if name not in HOP_BY_HOP and name not in connection_named
    ]


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in headers)


def _violation(
    exc: httpx.HTTPError, settings: UpstreamSettings, started: bool = False
) -> Violation:
    """A transport failure as modalgate's own error; never the exception's text verbatim."""
    if isinstance(exc, httpx.PoolTimeout):
        return Violation(
            ErrorCode.UPSTREAM_TIMEOUT,
            f"no connection to the upstream became free within {settings.connect_timeout_s:g} s",
        )
    if isinstance(exc, httpx.ConnectTimeout):
        return Violation(
            ErrorCode.UPSTREAM_TIMEOUT,
            f"the upstream did not accept a connection within {settings.connect_timeout_s:g} s",
        )
    if isinstance(exc, httpx.WriteTimeout):
        return Violation(
            ErrorCode.UPSTREAM_TIMEOUT,
            f"the upstream did not take the request body within {settings.write_timeout_s:g} s",
        )
    if isinstance(exc, httpx.TimeoutException):
        what = "sent nothing more" if started else "did not answer"
        return Violation(
            ErrorCode.UPSTREAM_TIMEOUT,
            f"the upstream {what} within {settings.read_timeout_s:g} s",
        )
    if isinstance(exc, httpx.ConnectError):
        return Violation(ErrorCode.UPSTREAM_UNAVAILABLE, "the upstream refused the connection")
    if started:
        return Violation(
            ErrorCode.UPSTREAM_UNAVAILABLE, "the upstream closed the connection mid-response"
        )
    return Violation(
        ErrorCode.UPSTREAM_UNAVAILABLE, "the upstream closed the connection without answering"
    )
