"""An HTTP/1.1 server protocol of modalgate's own, on httptools' public parser.

``modalgate serve`` reads requests in ways a general server does not (``protocol``:
bodies whole, heads measured, slow clients timed out). It used to get there by
subclassing uvicorn's private ``HttpToolsProtocol`` and ``RequestResponseCycle``, which
uvicorn may change in any release, so uvicorn was pinned to one minor version. This is
that base, owned: llhttp through ``httptools.HttpRequestParser``'s callbacks and
methods, the ASGI side in ``cycle``, and hosted by ``uvicorn.Server`` the way any
protocol class is (``uvicorn.Config(http=cls)``): built per connection with the
server's ``config``, ``server_state`` and ``app_state``, told to ``shutdown()`` when the
server stops, and counted in ``server_state`` so that the server can wait for it and
count its requests. uvicorn keeps what it does well (sockets, workers, lifespan,
signals, reload).

The shape follows uvicorn's httptools protocol (BSD-3-Clause), with two things left
out: websockets (the gateway serves none, its proxy closes them: an Upgrade request
is answered as HTTP/1.1 and the connection closed after it) and the access log (the
gateway writes its own, with the request id).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import httptools
from starlette.types import ASGIApp, Receive, Scope, Send

from modalgate.errors import ErrorCode, Violation, error_json
from modalgate.gateway.http.cycle import (
    HIGH_WATER_BYTES,
    STATUS_LINES,
    FlowControl,
    RequestCycle,
)

# Past this many bytes held, writes go out at once: a fast upstream's stream
# must not pile up here while the loop turn goes on.
FLUSH_AT_BYTES = 64 * 1024
ASGI_SPEC_VERSION = "2.3"

logger = logging.getLogger("modalgate.protocol")


class CoalescingTransport:
    """The transport as the protocol sees it: writes wait for the end of the loop turn.

    An answer's head and body come as two ASGI messages; written at once they are two
    packets and two wake-ups of the client. A proxy holds a small upstream answer
    whole, so both come in one turn of the event loop, and leave together at its end
    (what Envoy and nginx do with their write buffers): ~9% less CPU per small proxied
    request under ``modalgate serve`` (``benchmarks/p7_proxies.py``, text body)."""

    __slots__ = ("_held", "_held_bytes", "_loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None
        self._held_bytes = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        held = self._held
        if held is None:
            self._held = [data]
            self._held_bytes = len(data)
            self._loop.call_soon(self.flush)
        else:
            held.append(data)
            self._held_bytes += len(data)
        if self._held_bytes >= FLUSH_AT_BYTES:
            self.flush()

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        held = self._held
        if held is None:
            return
        self._held = None
        if self.transport.is_closing():
            return
        self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()  # a closing transport still sends what it was given
        self.transport.close()

    def write_eof(self) -> None:
        self.flush()  # what was written before the end goes before it
        self.transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self.transport.abort()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class Http11Protocol(asyncio.Protocol):
    """One client connection: requests parsed by llhttp, each run as an ASGI task in
    turn (a pipelined request waits for the answer before it, reading paused), the
    connection kept alive between them for ``config.timeout_keep_alive``.

    The reading itself is the subclass's (``ServeHttpProtocol.data_received``): it feeds
    the parser through ``feed``."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app: ASGIApp = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.root_path: str = config.root_path
        self.asgi_version: str = config.asgi_version
        self.limit_concurrency: int | None = config.limit_concurrency
        self.timeout_keep_alive: float = config.timeout_keep_alive
        # uvicorn's opt-in for https://github.com/python/cpython/issues/140947
        self.fresh_context: bool = getattr(config, "reset_contextvars", False)
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state
        self.parser = new_parser(self)
        self.transport: CoalescingTransport = None  # type: ignore[assignment]
        self.flow: FlowControl = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.pipeline: deque[tuple[RequestCycle, ASGIApp]] = deque()
        self.keep_alive_timer: asyncio.TimerHandle | None = None
        self.url = b""
        self.scope: dict[str, Any] = None  # type: ignore[assignment]
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        self.cycle: RequestCycle = None  # type: ignore[assignment]

    # ------------------------------------------------------------ the connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.connections.add(self)
        self.flow = FlowControl(transport)
        self.transport = CoalescingTransport(transport, self.loop)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        cycle = self.cycle
        if cycle is not None:
            if not cycle.response_complete:
                cycle.disconnected = True
            cycle.message_event.set()
        if self.flow is not None:
            self.flow.resume_writing()  # a send waiting on drain() wakes to the disconnect
        if exc is None:
            self.transport.close()
        self.cancel_keep_alive()
        self.parser = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        return None  # the transport closes; the app hears http.disconnect

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    def shutdown(self) -> None:
        """The server is stopping: an idle connection closes now, a busy one after its
        answer."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False

    def cancel_keep_alive(self) -> None:
        if self.keep_alive_timer is not None:
            self.keep_alive_timer.cancel()
            self.keep_alive_timer = None

    def _keep_alive_expired(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    # ------------------------------------------------------------ parsing

    def feed(self, data: bytes | memoryview) -> bool:
        """``data`` to llhttp; False when the connection reads nothing more: llhttp
        refused the bytes (answered 400) or an upgrade was asked for."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.refuse_malformed(str(exc))
            return False
        except httptools.HttpParserUpgrade:
            self.refuse_upgrade()
            return False
        return True

    def refuse_malformed(self, reason: str) -> None:
        """Bytes that are not HTTP/1.1: answered 400 in the error envelope, with llhttp's
        reason, and closed (nothing after them can be framed)."""
        self.transport.write(closing_answer(malformed(reason)))
        self.transport.close()

    def refuse_upgrade(self) -> None:
        """An Upgrade (websocket, h2c) is not taken: the request is answered as HTTP/1.1
        and the connection closed after it (llhttp reads nothing past such a request)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": ASGI_SPEC_VERSION},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace; RFC 9110 5.5 drops it
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        scope = self.scope
        http_version = parser.get_http_version()
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = url.query or b""
        app = self.app
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            logger.warning("Exceeded concurrency limit.")
            app = service_unavailable
        before = self.cycle
        self.cycle = RequestCycle(
            scope,
            self.transport,  # type: ignore[arg-type]
            self.flow,
            self.server_state.default_headers,
            self.expect_100_continue,
            keep_alive=http_version != "1.0" and parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        if before is None or before.response_complete:
            self._start(self.cycle, app)
        else:  # pipelined: its turn comes after the answer before it
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle.response_complete:
            return  # answered already (say, refused from its headers): the rest is dropped
        cycle.add_body(body)
        if cycle.whole:
            return  # on_message_complete wakes the app (or connection_lost, on a disconnect)
        if cycle.body_size > HIGH_WATER_BYTES:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.more_body = False
        cycle.message_event.set()

    # ------------------------------------------------------------ answers

    def _start(self, cycle: RequestCycle, app: ASGIApp) -> None:
        run = cycle.run_asgi(app)
        if self.fresh_context:
            task = self.loop.create_task(run, context=contextvars.Context())
        else:
            task = self.loop.create_task(run)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_response_complete(self) -> None:
        """The next pipelined request starts, or the keep-alive clock does."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.cancel_keep_alive()
        self.flow.resume_reading()
        if self.pipeline:
            self._start(*self.pipeline.pop())
        else:
            self.keep_alive_timer = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_expired
            )


def new_parser(protocol: Http11Protocol) -> httptools.HttpRequestParser:
    parser = httptools.HttpRequestParser(protocol)
    # What follows a request that closes the connection is left unread, not refused:
    # the request before it still gets its answer.
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


async def service_unavailable(scope: Scope, receive: Receive, send: Send) -> None:
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"19"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": b"Service Unavailable"})


def malformed(reason: str) -> Violation:
    return Violation(ErrorCode.INVALID_REQUEST, f"the request is not valid HTTP/1.1: {reason}")


@lru_cache(maxsize=32)
def closing_answer(violation: Violation) -> bytes:
    """A whole answer in the error envelope, written by the protocol itself; the
    connection closes after it."""
    body = error_json([violation])
    status = violation.status
    head = STATUS_LINES[status] + (
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % len(body)
    )
    return head + body


def _address(info: object) -> tuple[str, int] | None:
    """A socket's (host, port); None for a Unix socket."""
    if isinstance(info, (list, tuple)) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None
