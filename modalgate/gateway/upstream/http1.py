"""One HTTP/1.1 client connection: an asyncio Protocol around httptools' response parser.

The pool (pool.py) owns the policy: which connection, when to retry, when to keep
one. This module owns the wire: the request as written (its head made by
request_head.py), the response as llhttp parses it, timeouts between two reads and
per body chunk written, and backpressure both ways (asyncio's flow control out,
``pause_reading`` in). Every failure leaves here as an httpx exception, the family
the proxy maps to 502/504.

Whoever waits on a connection (the request's task, then whoever reads the body; a
streamed upload's task, while the request's waits on the head) waits on a future of its
own: every event (data, end of file, writable again, the upload's end) wakes them all,
and each loop re-checks its own condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterable

import httptools
import httpx

# Unread response bytes past which the socket stops being read; reading resumes below
# the low mark, so a slow client slows the upstream instead of filling our memory.
READ_HIGH_WATER = 64 * 1024
READ_LOW_WATER = 16 * 1024
# A response head (or trailers) larger than this is refused: llhttp sets no limit.
MAX_HEAD_BYTES = 256 * 1024
_LAST_CHUNK = b"0\r\n\r\n"
_timeout = getattr(asyncio, "timeout", None)  # 3.11+


class _Unasked(Exception):
    """Raised from the parser's callback to stop it past the response asked for: a HEAD
    response ends at its headers (llhttp, through httptools, cannot be told that no
    body follows), and a second response to one request is a fault."""


class Connection(asyncio.Protocol):
    """One keep-alive connection to the upstream, one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiters: list[asyncio.Future[bool]] = []  # one a waiting coroutine
        self._write_paused = False
        self._reading_paused = False
        self.open = True  # False once either side closed it: never used again
        self.active = False  # in an exchange; bytes from the peer while idle are a fault
        self.reused = False  # served an exchange before this one
        self.idle_since = 0.0
        self._reset(head_only=False)

    def _reset(self, head_only: bool) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False  # the response was read to its end
        self.keep_alive = False
        self.received = False  # any response byte in this exchange (no retry after one)
        self._upload: asyncio.Task[None] | None = None  # a streamed body going out
        self._upload_error: BaseException | None = None
        self._cut = False  # the request body was not sent whole
        self._head_only = head_only
        self._informational = False
        self._error: tuple[type[httpx.TransportError], str] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._header_bytes = 0

    # -- asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a small request head must not wait for Nagle
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            # Nothing was asked (a 408 before an idle close, a pipelined extra): unusable.
            self.open = False
            self._close()
            return
        self.received = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.complete:  # a HEAD's end, or bytes after the response: keep it, not the link
                self.keep_alive = False
            else:
                self._fail(httpx.RemoteProtocolError, f"malformed response: {exc}")
        self._wake()

    def eof_received(self) -> bool | None:
        self._lost(None)
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # -- httptools' callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            # Bytes after the response's end start another message (a 204 with a body, a
            # pipelined extra): read on the next exchange they would be its answer.
            raise _Unasked

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEAD_BYTES:
            raise _Unasked  # failed as a malformed response: no bound otherwise
        if not self.head_done:  # trailers after a chunked body are dropped, as proxies do
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            raise _Unasked  # a second response to one request: the parser stops here
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: the real answer follows
            self._informational = True
            self.headers = []
            return
        self.status = status
        self.head_done = True
        if self._head_only:
            self._end_message(keep_alive=False)  # the parser is spent: no reuse
            raise _Unasked

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
        else:
            self._end_message(self._parser.should_keep_alive())

    # -- the pool's side

    def start(self, head_only: bool) -> None:
        """Ready for a new exchange: fresh response state."""
        if self.active or self.reused:
            self._reset(head_only)
        else:
            self._head_only = head_only
        self.active = True

    def finish(self) -> bool:
        """End the exchange; True if the connection may serve another."""
        self.active = False
        self.reused = True
        upload = self._upload
        if upload is not None and (not upload.done() or self._upload_error is not None):
            self._cut = True
        if self.open and self.complete and self.keep_alive and not self._chunks and not self._cut:
            return True
        self.close()
        return False

    def close(self) -> None:
        self.open = False
        if self._upload is not None:
            self._upload.cancel()
        self._close()

    def write(self, data: bytes) -> None:
        self._transport.write(data)  # type: ignore[union-attr]

    async def send_whole(self, head: bytes, body: bytes, timeout: float | None) -> None:
        """A body already in memory, sent with the head in one call (no copy, no upload
        task), then waited on while the upstream has not taken it: each wait for the
        transport to drain within ``timeout``, as a streamed body's chunks are. An answer
        arriving first ends the wait (an early 413), as it ends a stream."""
        self._transport.writelines((head, body))  # type: ignore[union-attr]
        try:
            await self._until_taken(timeout)
        except httpx.WriteTimeout:
            self.abort()  # a graceful close would wait on unsent bytes the peer does not take
            raise
        if self._write_paused:
            self._cut = True  # answered with our body still going out: not reused
        self._raise_if_closed_mid_upload()

    def start_upload(
        self,
        content: AsyncIterable[bytes],
        length: int | None,
        chunked: bool,
        timeout: float | None,
    ) -> None:
        """Send a streamed body from a task of its own while the head is awaited: an
        upstream may answer before the body is out (413), and then the answer goes back
        at once, whatever the client's upload does (as aiohttp's writer task did)."""
        self._upload = self._loop.create_task(self._send_stream(content, length, chunked, timeout))
        self._upload.add_done_callback(self._upload_ended)

    def _upload_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._upload_error is None:
            self._upload_error = task.exception()
        self._wake()

    async def _send_stream(
        self,
        content: AsyncIterable[bytes],
        length: int | None,
        chunked: bool,
        timeout: float | None,
    ) -> None:
        try:
            await self._send_chunks(content, length, chunked, timeout)
        except asyncio.CancelledError:
            raise  # the exchange is over: whoever cancelled closes the connection
        except BaseException as exc:  # the client went away, or the upstream stopped reading
            self._upload_error = exc  # before the abort, so the head's waiter sees this first
            self.abort()  # a graceful close would wait on unsent bytes the peer does not take
            raise

    async def _send_chunks(
        self,
        content: AsyncIterable[bytes],
        length: int | None,
        chunked: bool,
        timeout: float | None,
    ) -> None:
        """Each chunk taken by the upstream within ``timeout``; clipped to ``length`` when
        the caller declared one; stops once the upstream has answered."""
        remaining = length
        async for chunk in content:
            if not self.open or self.head_done:
                self._cut = True  # the upstream would read what is left as the next request
                break
            if remaining is not None:
                chunk = chunk[:remaining]
                remaining -= len(chunk)
            if not chunk:
                continue  # an empty chunk would end a chunked body
            if chunked:
                chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
            self.write(chunk)
            await self._until_taken(timeout)  # on a timeout, _send_stream aborts
        else:
            if remaining:  # the upstream would take the next request as the rest of this one
                self._cut = True
                raise httpx.LocalProtocolError("the request body ended before its Content-Length")
            if chunked and self.open:
                self.write(_LAST_CHUNK)
        self._raise_if_closed_mid_upload()

    async def _until_taken(self, timeout: float | None) -> None:
        """While the transport holds what we wrote and the upstream has not answered:
        each wait for it to drain within ``timeout``."""
        while self._write_paused and self.open and not self.head_done:
            if not await self._wait(timeout):
                raise httpx.WriteTimeout("the upstream stopped reading the request body")

    def _raise_if_closed_mid_upload(self) -> None:
        if not self.open and not self.head_done:
            self._raise()
            raise httpx.WriteError("the upstream closed the connection during the upload")

    async def read_head(self, timeout: float | None) -> None:
        """Until the response's head; the read timeout runs once the body is out."""
        while not self.head_done:
            if self._upload_error is not None:
                raise self._upload_error
            self._raise()
            if not self.open:
                raise httpx.RemoteProtocolError("the upstream closed without a response")
            uploading = self._upload is not None and not self._upload.done()
            if not await self._wait(None if uploading else timeout) and not uploading:
                raise httpx.ReadTimeout("the upstream sent no response in time")

    def take(self) -> bytes | None:
        """The next body chunk, b"" at the end of the body, None if none is here yet."""
        if self._chunks:
            chunk = self._chunks.popleft()
            self._buffered -= len(chunk)
            if self._reading_paused and self._buffered <= READ_LOW_WATER:
                self._reading_paused = False
                if self.open:
                    self._transport.resume_reading()  # type: ignore[union-attr]
            return chunk
        if self.complete:
            return b""
        self._raise()
        if not self.open:
            raise httpx.RemoteProtocolError("the upstream closed mid-response")
        return None

    async def wait_body(self, timeout: float | None) -> None:
        if not await self._wait(timeout):
            raise httpx.ReadTimeout("the upstream sent nothing more in time")

    def abort(self) -> None:
        self.open = False
        if self._transport is not None:
            self._transport.abort()

    # -- inside

    async def _wait(self, timeout: float | None) -> bool:
        """Until the next event; False if ``timeout`` passed first."""
        waiter: asyncio.Future[bool] = self._loop.create_future()
        timer = None if timeout is None else self._loop.call_later(timeout, _expire, waiter)
        self._waiters.append(waiter)
        try:
            return await waiter
        finally:
            self._waiters.remove(waiter)
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(True)

    def _end_message(self, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive

    def _fail(self, error: type[httpx.TransportError], message: str) -> None:
        if self._error is None:
            self._error = (error, message)
        self.abort()

    def _raise(self) -> None:
        if self._error is not None:
            error, message = self._error
            raise error(message)

    def _lost(self, exc: Exception | None) -> None:
        self.open = False
        if self.active and not self.complete and self._error is None:
            if self.head_done and exc is None and not self._framed():
                self._end_message(keep_alive=False)  # a body that ends when the link does
            elif exc is not None:
                self._error = (httpx.ReadError, f"the upstream connection failed: {exc!r}")
            else:
                where = "mid-response" if self.head_done else "without a response"
                self._error = (httpx.RemoteProtocolError, f"the upstream closed {where}")
        self._wake()

    def _framed(self) -> bool:
        """Whether the response declared its body's end (Content-Length or chunked)."""
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding"
                and value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
            ):
                return True
        return False

    def _close(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if transport.get_write_buffer_size():
                transport.abort()  # unsent bytes the peer will not take: do not wait on them
            else:
                transport.close()


class ConnectFailure(Exception):
    """The cause of a ConnectError: the OS's error as ``os_error``, where the readiness
    probe (service/health.py) tells a refusal from an unknown host."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(os_error)
        self.os_error = os_error


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


async def connect(
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    timeout: float | None,
) -> Connection:
    """A new connection, TLS when ``ssl_context`` is given (the host's name verified)."""
    opening = loop.create_connection(
        lambda: Connection(loop),
        host,
        port,
        ssl=ssl_context,
        server_hostname=host if ssl_context is not None else None,
    )
    try:
        if _timeout is None:  # Python 3.10
            _, protocol = await asyncio.wait_for(opening, timeout)
        else:
            # Not wait_for: on 3.11 it returns the connection, dropping a cancel that
            # arrives as the connection is made (the client gone, the exchange over).
            async with _timeout(timeout):
                _, protocol = await opening
    except asyncio.TimeoutError:
        raise httpx.ConnectTimeout("the upstream did not accept a connection in time") from None
    except OSError as exc:  # refused, unreachable, unresolvable, a TLS certificate refused
        failure = ConnectFailure(exc)
        raise httpx.ConnectError(f"cannot connect to the upstream: {exc!r}") from failure
    return protocol
