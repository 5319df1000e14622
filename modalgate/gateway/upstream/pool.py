"""The proxy's connection pool to one upstream: our own HTTP/1.1 client behind httpx's
transport protocol.

Why our own client: the gateway speaks HTTP twice per request, so the client's cost
per request is most of the proxy's. httpcore's HTTP/1.1 (h11, a pure-Python parser;
headers and body in separate writes) cost 1.09 ms of CPU per request in a minimal
ASGI proxy, aiohttp's 0.52 ms; and with aiohttp, a profile of ``modalgate serve``
still put ~34% of the gateway's CPU for a small text request in its client
(ClientSession.request, ClientResponse, the connector, timers, tracing, yarl URLs,
CIMultiDict headers). A proxy needs none of that: a connection (http1.py: an asyncio
Protocol around httptools' parser, llhttp, the C parser uvicorn uses) and this pool.
Measured on the same 2 cores, runs interleaved (benchmarks/p7_proxies.py --quick):
``serve``'s CPU per proxied text request 0.71-0.73 ms with aiohttp, 0.44-0.50 ms with
this client (Envoy 0.15-0.19 ms); the client is now ~13% of serve's samples in a
py-spy profile, ~5 of them its one write system call per request. The pool keeps
httpx's transport protocol and exceptions, so health probes and model lists use it
like any httpx transport, and the proxy maps one family of errors.

It needs an asyncio event loop: uvicorn (the default), hypercorn's asyncio and uvloop
workers and granian all run one; under trio the pool refuses to start.

What a proxy must not do, and general-purpose clients do by default: keep cookies
from one user's response for the next user's request, follow redirects, decompress
bodies, read proxy settings from the environment, add Accept, Accept-Encoding,
User-Agent or Content-Type headers the client never sent. This client has none of it.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator

import anyio
import httpx

from modalgate.gateway.upstream.http1 import Connection, connect
from modalgate.gateway.upstream.request_head import encode_head

# Under the usual 5 s keep-alive of uvicorn (vLLM, SGLang): we drop first.
KEEPALIVE_EXPIRY_S = 4.0
# A body in memory up to this size is joined to the head and sent in one write; a
# bigger one goes with it in one writelines call (no copy), its drain timed.
JOIN_MAX_BYTES = 64 * 1024

# A request that failed on a reused connection before any response byte: the peer
# closed it as we sent (its keep-alive ran out), so the request never reached it.
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# A reused connection that failed with no answer is sent on again only as the close of
# an idle connection looks: within this time of the write, whatever the method; later
# only an idempotent request (a POST the upstream read, worked on and died with must
# not run twice).
STALE_RETRY_WINDOW_S = 0.1
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})


class UpstreamResponse:
    """Status, raw headers and body of one upstream response; ``aclose`` gives the
    connection back (kept only when the body was read to its end)."""

    __slots__ = ("_conn", "_pool", "_read_timeout", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: Connection, read_timeout: float | None) -> None:
        self.status = conn.status
        self.headers: list[tuple[bytes, bytes]] = conn.headers
        self._conn: Connection | None = conn
        self._pool = pool
        self._read_timeout = read_timeout

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked, not decompressed."""
        conn = self._conn
        if conn is None:
            return
        while True:
            chunk = conn.take()
            if chunk is None:
                await conn.wait_body(self._read_timeout)
            elif chunk:
                yield chunk
            else:
                return

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)


class UpstreamPool(httpx.AsyncBaseTransport):
    def __init__(
        self,
        base_url: httpx.URL,
        max_connections: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._host = base_url.raw_host.decode("ascii")  # IDNA-encoded; IPv6 without brackets
        self._port = base_url.port or (443 if base_url.scheme == "https" else 80)
        self.ssl_context = ssl_context or (
            httpx.create_ssl_context() if base_url.scheme == "https" else None
        )
        # The bound on connections: waiting here is a pool timeout, told apart from a
        # connect timeout. A slot is held from the request to the response's aclose.
        self._slots = anyio.Semaphore(max_connections, fast_acquire=True)
        self._idle: list[Connection] = []  # most recently used last
        self._closed = False

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterable[bytes] | None,
        timeouts: dict[str, float | None],
    ) -> UpstreamResponse:
        """The proxy's hot path, without building httpx's request and response objects.

        ``headers`` carry Host and go out byte for byte; the body's framing is the
        client's Content-Length if there is one (a stream clipped to it), else
        Content-Length for bytes and chunked for a stream.
        """
        try:
            self._slots.acquire_nowait()  # the common case: no cancel scope to set up
        except anyio.WouldBlock:
            try:
                with anyio.fail_after(timeouts.get("pool")):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection to the upstream became free") from None
        try:
            head, length, chunked = encode_head(method, target, headers, content)
            conn = self._take_idle()
            if conn is not None:
                sent_at = time.monotonic()
                try:
                    await self._exchange(conn, method, head, content, length, chunked, timeouts)
                    return UpstreamResponse(self, conn, timeouts.get("read"))
                except _STALE:
                    conn.close()
                    if not _may_send_again(conn, method, content, time.monotonic() - sent_at):
                        raise
                except BaseException:
                    conn.close()
                    raise
            conn = await connect(
                _loop(), self._host, self._port, self.ssl_context, timeouts.get("connect")
            )
            try:
                await self._exchange(conn, method, head, content, length, chunked, timeouts)
            except BaseException:
                conn.close()
                raise
            return UpstreamResponse(self, conn, timeouts.get("read"))
        except BaseException:
            self._slots.release()
            raise

    @staticmethod
    async def _exchange(
        conn: Connection,
        method: bytes,
        head: bytes,
        content: bytes | AsyncIterable[bytes] | None,
        length: int | None,
        chunked: bool,
        timeouts: dict[str, float | None],
    ) -> None:
        """Send the request on ``conn`` and read the response's head."""
        conn.start(head_only=method == b"HEAD")
        if content is None:
            conn.write(head)
        elif isinstance(content, bytes):
            if chunked:  # the caller said Transfer-Encoding itself
                content = (
                    b"%x\r\n%b\r\n0\r\n\r\n" % (len(content), content) if content else b"0\r\n\r\n"
                )
            if len(content) <= JOIN_MAX_BYTES:
                conn.write(head + content)  # one write: the body rides with the headers
            else:
                await conn.send_whole(head, content, timeouts.get("write"))
        else:
            conn.write(head)
            conn.start_upload(content, length, chunked, timeouts.get("write"))
        await conn.read_head(timeouts.get("read"))

    def _take_idle(self) -> Connection | None:
        """The most recently used idle connection still open and fresh, if any."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.open:
                continue  # the peer closed it while idle
            if time.monotonic() - conn.idle_since > KEEPALIVE_EXPIRY_S:
                # The freshest is stale, so all are: the upstream may be closing them now.
                conn.close()
                for older in idle:
                    older.close()
                idle.clear()
                return None
            return conn
        return None

    def release(self, conn: Connection) -> None:
        """The response is closed: its connection back to the pool if reusable, and its slot."""
        try:
            if conn.finish() and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
        finally:
            self._slots.release()

    def release_slot(self) -> None:
        self._slots.release()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport protocol, for any httpx caller (health probes, model lists)."""
        body = await request.aread()  # the gateway's own requests: small or empty
        response = await self.request(
            request.method.encode(),
            request.url.raw_path,  # path and query
            request.headers.raw,
            body or None,
            request.extensions.get("timeout", {}),
        )
        return httpx.Response(
            response.status,
            headers=response.headers,
            stream=_HttpxStream(response),
            request=request,
        )

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("the upstream client needs an asyncio event loop") from None


class _HttpxStream(httpx.AsyncByteStream):
    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.iter_chunks():
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


def _may_send_again(conn: Connection, method: bytes, content: object, after_s: float) -> bool:
    """A reused connection's failure before any answer: the peer closed it as we sent."""
    if conn.received or not (content is None or isinstance(content, bytes)):
        return False  # answered in part, or a stream already consumed
    return after_s <= STALE_RETRY_WINDOW_S or method in IDEMPOTENT
