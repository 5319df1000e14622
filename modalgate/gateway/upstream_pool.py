"""The proxy's connection pool to one upstream: an httpx transport with a plain LIFO stack.

httpcore's general pool rescans every connection for every queued request, and
hands one idle connection to several waiters who then retry (encode/httpcore#822,
#1035); at a few dozen concurrent requests a gateway spent most of its CPU there
(benchmarks/p6_proxy_overhead.py). A proxy talks to one origin, so its pool can
be simple: take the most recently used idle connection, check it once, else open
a new one within ``max_connections``; put it back when its response is closed.
Each connection is still httpcore's own HTTP/1.1 connection.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterator

import anyio
import httpcore
import httpx

# Under the usual 5 s keep-alive of uvicorn (vLLM, SGLang): we drop first.
KEEPALIVE_EXPIRY_S = 4.0

_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    """httpcore's exceptions as httpx's, most specific first, as httpx's own transport does."""
    try:
        yield
    except Exception as exc:
        for source, target in _ERRORS:
            if isinstance(exc, source):
                raise target(str(exc)) from exc
        raise


class UpstreamPool(httpx.AsyncBaseTransport):
    def __init__(
        self,
        base_url: httpx.URL,
        max_connections: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.origin = httpcore.Origin(
            base_url.raw_scheme, base_url.raw_host, base_url.port or _default_port(base_url)
        )
        self.ssl_context = ssl_context or (
            httpx.create_ssl_context() if base_url.scheme == "https" else None
        )
        self._idle: list[httpcore.AsyncHTTPConnection] = []
        self._slots = anyio.Semaphore(max_connections, fast_acquire=True)
        self._all: set[httpcore.AsyncHTTPConnection] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport protocol, for any httpx caller (health probes, model lists)."""
        url = request.url
        target = url.raw_path  # path and query
        response = await self.request(
            request.method.encode(),
            target,
            request.headers.raw,
            request.stream,  # type: ignore[arg-type]
            request.extensions.get("timeout", {}),
        )
        return httpx.Response(
            response.status,
            headers=response.headers,
            stream=response.stream,  # type: ignore[arg-type]
            extensions=response.extensions,
            request=request,
        )

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: AsyncIterable[bytes] | None,
        timeouts: dict[str, float | None],
    ) -> httpcore.Response:
        """The proxy's hot path, without building httpx's request and response objects.

        ``headers`` must carry Host and the body's framing. The response's ``stream``
        gives the connection back to the pool when it is closed.
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
            connection = await self._connection()
            core_request = httpcore.Request(
                method,
                httpcore.URL(
                    scheme=self.origin.scheme,
                    host=self.origin.host,
                    port=self.origin.port,
                    target=target,
                ),
                headers=headers,
                content=content,
                extensions={"timeout": timeouts},
            )
            try:
                with _httpx_errors():
                    response = await connection.handle_async_request(core_request)
            except BaseException:
                await self._discard(connection)
                raise
        except BaseException:
            self._slots.release()
            raise
        response.stream = _ReturningStream(self, connection, response.stream)  # type: ignore[arg-type]
        return response

    async def _connection(self) -> httpcore.AsyncHTTPConnection:
        while self._idle:
            connection = self._idle.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            await self._discard(connection)
        connection = httpcore.AsyncHTTPConnection(
            self.origin, ssl_context=self.ssl_context, keepalive_expiry=KEEPALIVE_EXPIRY_S
        )
        self._all.add(connection)
        return connection

    async def _discard(self, connection: httpcore.AsyncHTTPConnection) -> None:
        self._all.discard(connection)
        with anyio.CancelScope(shield=True):
            await connection.aclose()

    async def release(self, connection: httpcore.AsyncHTTPConnection) -> None:
        """After the response: keep a clean keep-alive connection, close anything else."""
        try:
            if connection.is_idle() and connection in self._all:
                self._idle.append(connection)
            else:
                await self._discard(connection)
        finally:
            self._slots.release()

    async def aclose(self) -> None:
        for connection in list(self._all):
            await self._discard(connection)
        self._idle.clear()

    @property
    def connections(self) -> int:
        return len(self._all)


class _ReturningStream(httpx.AsyncByteStream):
    def __init__(
        self,
        pool: UpstreamPool,
        connection: httpcore.AsyncHTTPConnection,
        stream: AsyncIterator[bytes],
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._stream = stream
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True), _httpx_errors():
                await self._stream.aclose()  # type: ignore[attr-defined]
        finally:
            await self._pool.release(self._connection)


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80
