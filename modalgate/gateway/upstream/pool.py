"""The proxy's connection pool to one upstream: aiohttp's client behind httpx's transport protocol.

Why aiohttp and not httpcore: the gateway speaks HTTP twice per request, so the
client's cost per request is most of the proxy's. A minimal ASGI proxy under
uvicorn spent 1.09 ms of CPU per request on httpcore's HTTP/1.1 connections (h11,
a pure-Python parser; headers and body in separate writes) and 0.52 ms on
aiohttp's (llhttp, a C parser; headers and first body chunk in one write), with
the same upstream and load (benchmarks/p6_proxy_overhead.py measures the whole
gateway). The OpenAI SDK makes the same pairing for high-concurrency clients
(httpx's interface on an aiohttp transport). The pool keeps httpx's transport
protocol and exceptions, so health probes and model lists use it like any httpx
transport, and the proxy maps one family of errors.

aiohttp needs an asyncio event loop: uvicorn (the default), hypercorn's asyncio and
uvloop workers and granian all run one; under trio the pool refuses to start.

What a proxy must not do, and aiohttp would by default: keep cookies from one
user's response for the next user's request, follow redirects, decompress
bodies, read proxy settings from the environment, add Accept, Accept-Encoding,
User-Agent or Content-Type headers the client never sent. All switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterator

import aiohttp
import aiohttp.abc
import aiohttp.payload
import anyio
import httpx
import yarl

# Under the usual 5 s keep-alive of uvicorn (vLLM, SGLang): we drop first.
KEEPALIVE_EXPIRY_S = 4.0
_TARGET_CACHE_SIZE = 1024

_NOT_SENT = (
    aiohttp.hdrs.ACCEPT,
    aiohttp.hdrs.ACCEPT_ENCODING,
    aiohttp.hdrs.USER_AGENT,
    aiohttp.hdrs.CONTENT_TYPE,
)

# aiohttp's exceptions as httpx's, most specific first.
_ERRORS: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerTimeoutError, httpx.TimeoutException),
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),  # not HTTP, or malformed
    (aiohttp.ClientConnectionResetError, httpx.ReadError),
    (aiohttp.ClientError, httpx.NetworkError),
    (asyncio.TimeoutError, httpx.TimeoutException),
)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        target = next(t for source, t in _ERRORS if isinstance(exc, source))
        raise target(type(exc).__name__) from exc


@functools.lru_cache(maxsize=32)
def _client_timeout(connect: float | None, read: float | None) -> aiohttp.ClientTimeout:
    # httpx's read timeout is between two reads, like aiohttp's sock_read, which starts
    # once the request body is out; the write timeout is _TimedBody's.
    return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect, sock_read=read)


class _TimedBody(aiohttp.payload.AsyncIterablePayload):
    """A streamed request body whose every chunk the upstream must take within a time.

    aiohttp has no write timeout, and its read timeout starts only once the body
    is out, so an upstream that stops reading (a wedged server whose kernel still
    accepts connections) would hold an upload forever. Past the time the
    connection is aborted (a graceful close would wait for the unsent bytes), which
    fails the pending response; ``stalled`` tells the pool why.
    """

    def __init__(self, content: AsyncIterable[bytes], timeout_s: float) -> None:
        super().__init__(content)
        self._timeout_s = timeout_s
        self.stalled = False

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: aiohttp.abc.AbstractStreamWriter, content_length: int | None
    ) -> None:
        # The writer clips to the declared Content-Length itself.
        loop = asyncio.get_running_loop()

        def stall() -> None:
            self.stalled = True
            transport = writer.transport
            if transport is not None:
                transport.abort()

        assert self._iter is not None
        async for chunk in self._iter:
            timer = loop.call_later(self._timeout_s, stall)
            try:
                await writer.write(chunk)  # waits while more than 64 KiB are unsent
            finally:
                timer.cancel()


class UpstreamResponse:
    """Status, raw headers and body of one upstream response; ``aclose`` gives the
    connection back (kept only when the body was read to its end)."""

    __slots__ = ("_closed", "_pool", "_response", "headers", "status")

    def __init__(self, pool: UpstreamPool, response: aiohttp.ClientResponse) -> None:
        self.status = response.status
        self.headers: list[tuple[bytes, bytes]] = list(response.raw_headers)
        self._response = response
        self._pool = pool
        self._closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked, not decompressed."""
        with _httpx_errors():
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._response.release()  # reused if complete, closed otherwise
        finally:
            self._pool.release_slot()


class UpstreamPool(httpx.AsyncBaseTransport):
    def __init__(
        self,
        base_url: httpx.URL,
        max_connections: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._scheme = base_url.scheme
        # host[:port] as it goes on the wire: IPv6 in brackets, IDNA names encoded.
        self._authority = yarl.URL(str(base_url)).raw_authority
        self.ssl_context = ssl_context or (
            httpx.create_ssl_context() if base_url.scheme == "https" else None
        )
        # Our own bound (aiohttp's connector is unbounded): waiting here is a pool
        # timeout, told apart from a connect timeout.
        self._slots = anyio.Semaphore(max_connections, fast_acquire=True)
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[bytes, yarl.URL] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("the upstream client (aiohttp) needs asyncio") from None
            connector = aiohttp.TCPConnector(
                limit=0,
                keepalive_timeout=KEEPALIVE_EXPIRY_S,
                ssl=self.ssl_context if self.ssl_context is not None else True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=_NOT_SENT,
                trust_env=False,
                timeout=_client_timeout(None, None),
            )
        return self._session

    def _url(self, target: bytes) -> yarl.URL:
        """The URL of a raw request target, kept as the client sent it (no re-quoting)."""
        url = self._urls.get(target)
        if url is None:
            path, _, query = target.decode("latin-1").partition("?")
            url = yarl.URL.build(
                scheme=self._scheme,
                authority=self._authority,
                path=path,
                query_string=query,
                encoded=True,
            )
            if len(self._urls) >= _TARGET_CACHE_SIZE:
                self._urls.clear()
            self._urls[target] = url
        return url

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterable[bytes] | None,
        timeouts: dict[str, float | None],
    ) -> UpstreamResponse:
        """The proxy's hot path, without building httpx's request and response objects.

        ``headers`` carry Host; the body's framing is aiohttp's: the client's
        Content-Length if there is one, chunked for a stream of unknown length.
        Header values travel as UTF-8 (aiohttp writes str headers): a value that
        is not valid UTF-8 has its invalid bytes replaced.
        """
        try:
            self._slots.acquire_nowait()  # the common case: no cancel scope to set up
        except anyio.WouldBlock:
            try:
                with anyio.fail_after(timeouts.get("pool")):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection to the upstream became free") from None
        body = content
        if content is not None and not isinstance(content, bytes) and timeouts.get("write"):
            body = _TimedBody(content, timeouts["write"])  # type: ignore[arg-type]
        try:
            with _httpx_errors():
                response = await self._client().request(
                    method.decode("ascii"),
                    self._url(target),
                    headers=[
                        (name.decode("latin-1"), value.decode("utf-8", "replace"))
                        for name, value in headers
                    ],
                    data=body,
                    allow_redirects=False,
                    timeout=_client_timeout(timeouts.get("connect"), timeouts.get("read")),
                )
        except BaseException as exc:
            self._slots.release()
            if isinstance(body, _TimedBody) and body.stalled:
                raise httpx.WriteTimeout("the upstream stopped reading the request body") from exc
            raise
        return UpstreamResponse(self, response)

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
        if self._session is not None:
            session, self._session = self._session, None
            with anyio.CancelScope(shield=True):
                await session.close()


class _HttpxStream(httpx.AsyncByteStream):
    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.iter_chunks():
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()
