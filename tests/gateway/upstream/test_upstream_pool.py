"""The proxy's upstream client against upstreams that misbehave at the HTTP level, and over TLS.

A real ``modalgate serve`` process in front of raw-socket servers written here
(no HTTP library on that side, so each fault is exactly the bytes it says), and
in front of the toy upstream under uvicorn with a certificate from a test CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from unittest.mock import ANY

import httpx
import openai
import orjson
import pytest
import trustme
import uvicorn

import modalgate.gateway.upstream.http1 as http1_module
import modalgate.gateway.upstream.pool as pool_module
from conftest import chat, free_port, serve
from gateway_proc import GatewayProcess, metric
from modalgate.gateway.upstream.pool import UpstreamPool
from toy_upstream import ToyUpstream

CHAT = orjson.dumps(chat())
JSON = {"content-type": "application/json"}

Behaviour = Callable[[socket.socket], None]


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head


@pytest.fixture
def raw_upstream() -> Iterator[Callable[[Behaviour], str]]:
    """Start a server that answers every request with ``behaviour(conn)``; yields its URL."""
    listeners: list[socket.socket] = []
    stop = threading.Event()

    def start(behaviour: Behaviour) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.1)
        listeners.append(listener)

        def handle(conn: socket.socket) -> None:
            with conn:
                head = _read_request(conn)
                if head.startswith(b"GET /health "):  # the gateway's probes: healthy
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    return
                behaviour(conn)

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except (TimeoutError, OSError):
                    continue
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    stop.set()
    for listener in listeners:
        listener.close()


def _close(conn: socket.socket) -> None:
    pass  # the handler's `with` closes it: no answer at all


def _garbage(conn: socket.socket) -> None:
    conn.sendall(b"HELLO, THIS IS NOT HTTP\r\n\r\n")


def _truncated(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        b'{"id": "x"'
    )


def _headers_then_silence(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    stop = threading.Event()
    stop.wait(5)  # nothing more within the gateway's 1 s read timeout


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        (_close, "the upstream closed the connection without answering"),
        (_garbage, "the upstream closed the connection without answering"),
    ],
    ids=["closes-without-answering", "not-http"],
)
def test_an_upstream_that_does_not_answer_http_gives_502(raw_upstream, behaviour, message):
    with GatewayProcess("--upstream", raw_upstream(behaviour)) as gateway:
        response = httpx.post(gateway.url + "/v1/chat/completions", content=CHAT, headers=JSON)
        assert response.status_code == 502
        error = response.json()["error"]
        assert (error["code"], error["type"], error["message"]) == (
            "upstream_unavailable",
            "server_error",
            message,
        )
        assert "127.0.0.1" not in response.text  # no address, no exception text
        assert metric(gateway, "modalgate_upstream_errors_total", code="upstream_unavailable") == 1


@pytest.mark.parametrize(
    "behaviour", [_truncated, _headers_then_silence], ids=["closes-mid-body", "stalls-mid-body"]
)
def test_a_response_cut_short_is_aborted_not_completed(raw_upstream, behaviour):
    upstream = raw_upstream(behaviour)
    with GatewayProcess("--upstream", upstream, "--upstream-read-timeout", "1") as gateway:
        with pytest.raises(httpx.RemoteProtocolError):  # the client sees a cut, never a whole body
            httpx.post(gateway.url + "/v1/chat/completions", content=CHAT, headers=JSON)
        # The gateway is fine afterwards.
        assert httpx.get(gateway.url + "/healthz").status_code == 200
        code = "upstream_timeout" if behaviour is _headers_then_silence else "upstream_unavailable"
        assert metric(gateway, "modalgate_upstream_errors_total", code=code) == 1


@pytest.fixture(scope="module")
def tls_upstream(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The toy upstream under uvicorn with TLS; yields its https URL and the CA's file."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    folder = tmp_path_factory.mktemp("tls")
    ca_file, cert_file, key_file = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    toy = ToyUpstream()
    with serve(toy.app(), ssl_certfile=str(cert_file), ssl_keyfile=str(key_file)) as base:
        yield base.replace("http://", "https://"), ca_file


def test_an_https_upstream_is_verified_and_streams(tls_upstream):
    url, ca_file = tls_upstream
    with GatewayProcess("--upstream", url, env={"SSL_CERT_FILE": str(ca_file)}) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test", max_retries=0)
        messages = [{"role": "user", "content": "hello"}]
        completion = client.chat.completions.create(model="kimi-k3", messages=messages)
        assert completion.choices[0].message.content.startswith("toy saw ")
        stream = client.chat.completions.create(model="kimi-k3", messages=messages, stream=True)
        assert len([chunk for chunk in stream if chunk.choices]) >= 2


def test_an_https_upstream_with_an_unknown_ca_is_refused(tls_upstream):
    url, _ = tls_upstream
    with GatewayProcess("--upstream", url) as gateway:  # the test CA is not trusted here
        response = httpx.post(gateway.url + "/v1/chat/completions", content=CHAT, headers=JSON)
        assert response.status_code == 502
        assert response.json()["error"]["message"] == "the upstream refused the connection"


def test_an_ipv6_upstream_is_reached():
    toy = ToyUpstream()
    port = free_port_v6()
    server = uvicorn.Server(uvicorn.Config(toy.app(), host="::1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start on ::1"
            assert time.monotonic() < deadline, "uvicorn did not start on ::1 in time"
            time.sleep(0.01)
        with GatewayProcess("--upstream", f"http://[::1]:{port}") as gateway:
            response = httpx.post(gateway.url + "/v1/chat/completions", content=CHAT, headers=JSON)
            assert response.status_code == 200
            assert toy.received[0].headers["host"] == f"[::1]:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------ the pool itself, in-process
#
# UpstreamPool against real servers on 127.0.0.1 in the test's own event loop: uvicorn
# where a normal server does, raw asyncio servers (the bytes written here) for the
# faults no normal server makes. Each test runs one asyncio.run.

TIMEOUTS: dict[str, float | None] = {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0}
OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and de-framed body, as a server reads it; (b"", b"") at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b"", b""
    lowered = head.lower()
    if b"\r\ntransfer-encoding: chunked" in lowered:
        body = b""
        while size := int((await reader.readline()).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readline()
        return head, body
    match = re.search(rb"\r\ncontent-length: *(\d+)", lowered)
    return head, await reader.readexactly(int(match.group(1))) if match else b""


class RawServer:
    """An asyncio server running ``handler(reader, writer, n)`` for its nth connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = 0  # connections whose handler is done: the client closed, or it did
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = httpx.URL(f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the test is over
        finally:
            self.closed += 1
            writer.close()

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        head, body = await read_request(reader)
        if head:
            self.heads.append(head)
            self.bodies.append(body)
        return head


def answering(*responses: bytes, then_close: bool = False) -> Callable[[RawServer], Handler]:
    """A handler that answers each request on a connection with the next response."""

    def make(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            for response in responses:
                if not await server.read(reader):
                    return
                writer.write(response)
                await writer.drain()
            if not then_close:
                await reader.read()  # keep the connection until the client drops it

        return handler

    return make


def raw(handler_of: Callable[[RawServer], Handler]) -> RawServer:
    server = RawServer(None)  # type: ignore[arg-type]
    server.handler = handler_of(server)
    return server


async def fetch(
    pool: UpstreamPool,
    method: bytes = b"GET",
    content: bytes | AsyncIterable[bytes] | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    timeouts: dict[str, float | None] = TIMEOUTS,
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    response = await pool.request(method, b"/x", headers or [(b"host", b"up")], content, timeouts)
    try:
        body = b"".join([chunk async for chunk in response.iter_chunks()])
    finally:
        await response.aclose()
    return response.status, response.headers, body


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for what another task or the kernel does, however loaded the machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def free_slots(pool: UpstreamPool) -> int:
    return pool._slots.value


def connections_seen_app(ports: list[int], body: bytes = b"hello") -> Callable:
    """A raw ASGI app that records each request's client port (one per connection)."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        ports.append(scope["client"][1])
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def test_keep_alive_reuses_one_connection_for_sequential_requests():
    ports: list[int] = []
    with serve(connections_seen_app(ports)) as base:

        async def main():
            pool = UpstreamPool(httpx.URL(base), 4)
            for _ in range(5):
                assert await fetch(pool, b"POST", b"{}") == (200, ANY, b"hello")
            await pool.aclose()
            return pool

        pool = asyncio.run(main())
    assert len(ports) == 5 and len(set(ports)) == 1  # five requests, one connection
    assert free_slots(pool) == 4


def test_a_response_not_read_to_its_end_is_not_reused():
    ports: list[int] = []
    with serve(connections_seen_app(ports, b"x" * 2_000_000)) as base:

        async def main():
            pool = UpstreamPool(httpx.URL(base), 4)
            response = await pool.request(b"GET", b"/", [(b"host", b"up")], None, TIMEOUTS)
            async for _ in response.iter_chunks():
                break  # one chunk of 2 MB, then give up
            await response.aclose()
            assert pool._idle == []
            assert (await fetch(pool))[2] == b"x" * 2_000_000
            await pool.aclose()
            return pool

        pool = asyncio.run(main())
    assert len(set(ports)) == 2
    assert free_slots(pool) == 4


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["connection-close", "http-1.0"],
)
def test_a_response_that_closes_is_not_reused(response):
    async def main():
        async with raw(answering(response, then_close=True)) as server:
            pool = UpstreamPool(server.url, 4)
            assert (await fetch(pool))[2] == b"ok"
            assert (await fetch(pool))[2] == b"ok"
            return server.connections

    assert asyncio.run(main()) == 2


def test_an_idle_connection_the_upstream_closed_is_dropped_not_used():
    async def main():
        async with raw(answering(OK_EMPTY, then_close=True)) as server:
            pool = UpstreamPool(server.url, 4)
            assert (await fetch(pool))[2] == b"ok"
            await until(lambda: not pool._idle[0].open)  # the FIN, while it is idle
            assert (await fetch(pool))[2] == b"ok"
            return server.connections, len(server.heads)

    assert asyncio.run(main()) == (2, 2)  # no request lost on the closed one


def closing_after_first(delay_s: float = 0.0) -> Callable[[RawServer], Handler]:
    """The first connection answers once, then takes the next request and closes without
    a word: at once, as a server whose keep-alive ran out just as the request came in, or
    after ``delay_s``, as a worker that took the request and died on it."""

    def make(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            while await server.read(reader):
                if n == 1 and len(server.heads) > 1:
                    await asyncio.sleep(delay_s)
                    return
                writer.write(OK_EMPTY)

        return handler

    return make


stale_after_first = closing_after_first()


def test_a_request_on_a_stale_connection_is_retried_once_on_a_new_one():
    async def main():
        async with raw(stale_after_first) as server:
            pool = UpstreamPool(server.url, 4)
            assert (await fetch(pool))[2] == b"ok"
            assert (await fetch(pool, b"POST", b'{"a": 1}'))[2] == b"ok"
            return server.connections, server.bodies

    assert asyncio.run(main()) == (2, [b"", b'{"a": 1}', b'{"a": 1}'])


async def one_chunk(data: bytes = b"streamed") -> AsyncIterator[bytes]:
    yield data


def test_a_streamed_body_is_not_replayed_on_a_stale_connection():
    async def main():
        async with raw(stale_after_first) as server:
            pool = UpstreamPool(server.url, 4)
            await fetch(pool)
            with pytest.raises(httpx.RemoteProtocolError):
                await fetch(pool, b"POST", one_chunk())
            assert free_slots(pool) == 4
            return server.connections

    assert asyncio.run(main()) == 1


def test_a_new_connection_that_closes_without_answering_is_not_retried():
    async def main():
        async with raw(answering(then_close=True)) as server:
            pool = UpstreamPool(server.url, 4)
            # A close before our request arrived is a FIN; after, the kernel's reset of the
            # unread request: which one depends on the scheduling, and both are no answer.
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)) as failed:
                await fetch(pool, b"POST", b"{}")
            assert re.search("without a response|connection failed", str(failed.value))
            assert free_slots(pool) == 4
            return server.connections

    assert asyncio.run(main()) == 1


died_working_after_first = closing_after_first(pool_module.STALE_RETRY_WINDOW_S * 3)


def test_a_post_the_upstream_took_and_died_with_is_not_sent_again():
    async def main():
        async with raw(died_working_after_first) as server:
            pool = UpstreamPool(server.url, 4)
            assert (await fetch(pool))[2] == b"ok"
            with pytest.raises(httpx.RemoteProtocolError):
                await fetch(pool, b"POST", b'{"n": 2}')
            assert free_slots(pool) == 4
            return server.connections, server.bodies

    assert asyncio.run(main()) == (1, [b"", b'{"n": 2}'])  # run once, not twice


def test_an_idempotent_request_is_sent_again_after_the_window_too():
    async def main():
        async with raw(died_working_after_first) as server:
            pool = UpstreamPool(server.url, 4)
            assert (await fetch(pool))[2] == b"ok"
            assert (await fetch(pool, b"GET"))[2] == b"ok"
            return server.connections

    assert asyncio.run(main()) == 2


@pytest.mark.parametrize(
    "extra",
    [
        b"HTTP/1.1 200 OK\r\nX-Smuggled: a",  # a head begun, not finished
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnot",  # a whole response
    ],
    ids=["part-of-a-head", "a-whole-response"],
)
def test_bytes_after_a_response_never_reach_the_next_request(extra):
    """A response followed, in the same read, by the start of another: the connection is
    dropped, and the next request gets its own answer from a new one."""

    async def main():
        async with raw(answering(OK_EMPTY + extra, OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            assert await fetch(pool) == (200, ANY, b"ok")
            assert pool._idle == []
            status, headers, body = await fetch(pool)
            assert (status, body) == (200, b"ok")
            assert all(b"smuggled" not in name.lower() for name, _ in headers)
            return server.connections

    assert asyncio.run(main()) == 2


def test_a_204_with_a_body_is_not_reused():
    sneaky = b"HTTP/1.1 204 No Content\r\nContent-Length: 40\r\n\r\n" + (
        b"HTTP/1.1 200 OK\r\nSet-Cookie: x=1; a="
    ).ljust(40, b"a")

    def first_connection_sneaky(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            while await server.read(reader):
                writer.write(sneaky if n == 1 else OK_EMPTY)

        return handler

    async def main():
        async with raw(first_connection_sneaky) as server:
            pool = UpstreamPool(server.url, 4)
            assert (await fetch(pool))[:1] == (204,)
            status, headers, body = await fetch(pool)
            assert (status, body) == (200, b"ok")
            assert all(name.lower() != b"set-cookie" for name, _ in headers)
            return server.connections

    assert asyncio.run(main()) == 2


def test_a_response_head_past_the_limit_is_a_protocol_error():
    big = b"x" * (http1_module.MAX_HEAD_BYTES + 1)
    response = b"HTTP/1.1 200 OK\r\nX-Big: " + big + b"\r\nContent-Length: 2\r\n\r\nok"

    async def main():
        async with raw(answering(response)) as server:
            pool = UpstreamPool(server.url, 4)
            with pytest.raises(httpx.RemoteProtocolError, match="malformed response"):
                await fetch(pool)
            assert free_slots(pool) == 4

    asyncio.run(main())


def test_chunked_only_as_the_last_coding_frames_a_body():
    """``chunked, gzip``: the body runs to the close (RFC 9112 6.3), which ends it cleanly."""
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nraw bytes"

    async def main():
        async with raw(answering(response, then_close=True)) as server:
            pool = UpstreamPool(server.url, 4)
            assert await fetch(pool) == (200, ANY, b"raw bytes")
            assert pool._idle == []

    asyncio.run(main())


def test_a_body_that_does_not_match_its_content_length_is_refused():
    async def stream() -> AsyncIterator[bytes]:
        yield b"abc"

    async def main():
        async with raw(answering(OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            length = [(b"host", b"up"), (b"content-length", b"2")]
            with pytest.raises(httpx.LocalProtocolError, match="Content-Length"):
                await fetch(pool, b"POST", b"ok" + b"GET /smuggled HTTP/1.1\r\n\r\n", length)
            short = [(b"host", b"up"), (b"content-length", b"10")]
            with pytest.raises(httpx.LocalProtocolError, match="ended before"):
                await fetch(pool, b"POST", stream(), short)
            assert free_slots(pool) == 4
            return server.heads

    assert asyncio.run(main()) == []  # nothing the upstream could take as a request


def test_idle_connections_past_the_keep_alive_expiry_are_closed(monkeypatch):
    monkeypatch.setattr(pool_module, "KEEPALIVE_EXPIRY_S", 0.05)

    async def main():
        async with raw(answering(OK_EMPTY, OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            await fetch(pool)
            await asyncio.sleep(0.1)
            await fetch(pool)
            return server.connections

    assert asyncio.run(main()) == 2


def test_a_chunked_response_is_de_chunked_and_the_connection_reused():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Own: kept\r\n\r\n"
        b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nTrailer-Thing: x\r\n\r\n"
    )

    async def main():
        async with raw(answering(chunked, OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            status, headers, body = await fetch(pool)
            assert (await fetch(pool))[2] == b"ok"
            return status, headers, body, server.connections

    status, headers, body, connections = asyncio.run(main())
    assert (status, body, connections) == (200, b"hello world", 1)
    assert headers == [(b"Transfer-Encoding", b"chunked"), (b"X-Own", b"kept")]  # as sent


@pytest.mark.parametrize(
    ("method", "response", "reused"),
    [
        (b"HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", False),
        (b"GET", b"HTTP/1.1 204 No Content\r\nContent-Length: 1000\r\n\r\n", True),
        (b"GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1000\r\n\r\n", True),
    ],
    ids=["head", "204", "304"],
)
def test_responses_without_a_body_end_at_their_headers(method, response, reused):
    def first_without_body(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            while await server.read(reader):
                writer.write(response if len(server.heads) == 1 else OK_EMPTY)

        return handler

    async def main():
        async with raw(first_without_body) as server:
            pool = UpstreamPool(server.url, 4)
            _, headers, body = await fetch(pool, method)
            assert body == b""
            assert headers == [(b"Content-Length", b"1000")]
            assert (await fetch(pool))[2] == b"ok"
            return server.connections

    assert asyncio.run(main()) == (1 if reused else 2)


def test_informational_responses_are_skipped():
    response = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone"
    )

    async def main():
        async with raw(answering(response, OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            result = await fetch(pool, b"POST", b"{}")
            assert (await fetch(pool))[2] == b"ok"
            return result, server.connections

    assert asyncio.run(main()) == ((201, [(b"Content-Length", b"4")], b"done"), 1)


def test_a_body_that_ends_with_the_connection_is_whole_and_not_reused():
    async def main():
        response = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"
        async with raw(answering(response, then_close=True)) as server:
            pool = UpstreamPool(server.url, 4)
            result = await fetch(pool)
            assert pool._idle == []
            return result

    assert asyncio.run(main())[2] == b"until the end"


def test_a_second_response_to_one_request_is_not_read_and_the_connection_is_dropped():
    double = OK_EMPTY + b"HTTP/1.1 500 Unasked\r\nContent-Length: 3\r\n\r\nbad"

    async def main():
        async with raw(answering(double, double)) as server:
            pool = UpstreamPool(server.url, 4)
            first = await fetch(pool)
            second = await fetch(pool)
            return first, second, server.connections

    first, second, connections = asyncio.run(main())
    assert first == second == (200, [(b"Content-Length", b"2")], b"ok")
    assert connections == 2


@pytest.mark.parametrize(
    ("response", "error", "message"),
    [
        (b"HELLO, THIS IS NOT HTTP\r\n\r\n", httpx.RemoteProtocolError, "malformed response"),
        (b"HTTP/1.1 2OO OK\r\n\r\n", httpx.RemoteProtocolError, "malformed response"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nok",
            httpx.RemoteProtocolError,
            "malformed response",
        ),
        (
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
            httpx.RemoteProtocolError,
            "malformed response",
        ),
    ],
    ids=["not-http", "bad-status", "two-lengths", "upgrade"],
)
def test_a_malformed_response_is_a_protocol_error(response, error, message):
    async def main():
        async with raw(answering(response)) as server:
            pool = UpstreamPool(server.url, 4)
            with pytest.raises(error, match=message):
                await fetch(pool)
            assert free_slots(pool) == 4 and pool._idle == []

    asyncio.run(main())


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ncut",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    ],
    ids=["content-length", "chunked"],
)
def test_a_body_cut_short_by_the_upstream_is_a_protocol_error(response):
    async def main():
        async with raw(answering(response, then_close=True)) as server:
            pool = UpstreamPool(server.url, 4)
            with pytest.raises(httpx.RemoteProtocolError, match="mid-response"):
                await fetch(pool)
            assert free_slots(pool) == 4 and pool._idle == []

    asyncio.run(main())


def test_reading_stops_while_the_consumer_does_not_read():
    size = 32_000_000  # more than loopback's socket buffers on both sides hold
    sent = asyncio.Event()

    def big(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            await server.read(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            writer.write(b"x" * size)
            await writer.drain()
            sent.set()
            await reader.read()

        return handler

    async def main():
        async with raw(big) as server:
            pool = UpstreamPool(server.url, 4)
            response = await pool.request(b"GET", b"/", [(b"host", b"up")], None, TIMEOUTS)
            conn = response._conn
            await until(lambda: conn._reading_paused)
            await asyncio.sleep(0.2)
            # The upstream is held back by TCP: we hold ~64 KiB plus one socket read.
            assert conn._reading_paused and not sent.is_set()
            assert conn._buffered < 64 * 1024 + 512 * 1024
            total = 0
            async for chunk in response.iter_chunks():
                total += len(chunk)
            await response.aclose()
            return total, sent.is_set(), len(pool._idle)

    assert asyncio.run(main()) == (size, True, 1)


def test_crlf_or_nul_in_a_header_is_refused_before_anything_is_sent():
    async def main():
        async with raw(answering(OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            for name, value in [
                (b"x-a", b"1\r\nx-injected: 1"),
                (b"x-a", b"1\nx-b: 2"),
                (b"x-a\r\nx-b", b"1"),
                (b"x-a", b"1\x00"),
            ]:
                with pytest.raises(httpx.LocalProtocolError):
                    await fetch(pool, headers=[(b"host", b"up"), (name, value)])
            assert free_slots(pool) == 4
            return server.connections

    assert asyncio.run(main()) == 0


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


@pytest.mark.parametrize(
    ("content", "headers", "framing", "body"),
    [
        (b"{}", [], b"content-length: 2", b"{}"),
        (b"{}", [(b"Content-Length", b"2")], b"Content-Length: 2", b"{}"),
        (b"x" * 200_000, [], b"content-length: 200000", b"x" * 200_000),
        (chunks(b"ab", b"", b"cd"), [], b"transfer-encoding: chunked", b"abcd"),
        (chunks(b"ab", b"cdef"), [(b"content-length", b"3")], b"content-length: 3", b"abc"),
        (None, [], None, b""),
    ],
    ids=["bytes", "bytes-with-length", "big-bytes", "stream", "stream-clipped", "none"],
)
def test_the_request_goes_out_as_given_with_only_its_framing_added(content, headers, framing, body):
    async def main():
        async with raw(answering(OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            given = [(b"Host", b"up.example"), (b"X-Case", b"Kept As Is"), *headers]
            await fetch(pool, b"PUT", content, given)
            return server.heads[0], server.bodies[0]

    head, received = asyncio.run(main())
    lines = [b"PUT /x HTTP/1.1", b"Host: up.example", b"X-Case: Kept As Is"]
    if framing is not None:
        lines.append(framing)
    assert head == b"\r\n".join(lines) + b"\r\n\r\n"  # no User-Agent, Accept, ...
    assert received == body


def test_an_answer_before_the_upload_ends_is_returned_and_the_connection_dropped():
    def early(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            if n > 1:
                await answering(OK_EMPTY)(server)(reader, writer, n)
                return
            await reader.readuntil(b"\r\n\r\n")  # the head only: the body is too large
            writer.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 3\r\n\r\nbig")
            await reader.read()

        return handler

    async def slow() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"x" * 1000
            await asyncio.sleep(0.02)

    async def main(content: object):
        async with raw(early) as server:
            pool = UpstreamPool(server.url, 4)
            status, _, body = await fetch(pool, b"POST", content)
            assert (await fetch(pool))[2] == b"ok"
            return status, body, server.connections

    assert asyncio.run(main(slow())) == (413, b"big", 2)
    # A body in memory, more than the sockets hold: the answer ends the wait on it.
    assert asyncio.run(main(b"x" * 20_000_000)) == (413, b"big", 2)


def test_an_answer_comes_back_while_the_clients_upload_stalls():
    # The body's next chunk never comes (a client that stalls, or an ASGI server whose
    # receive() waits for the disconnect): the upstream's answer still goes back at once.
    stopped = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        try:
            yield b'{"a": 1}'
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    async def main():
        async with raw(answering(OK_EMPTY, OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 4)
            given = [(b"host", b"up"), (b"content-length", b"8")]
            started = time.monotonic()
            assert (await fetch(pool, b"POST", stalls(), given))[2] == b"ok"
            assert time.monotonic() - started < 1.5
            await asyncio.wait_for(stopped.wait(), 2)  # the upload is stopped with the response
            assert pool._idle == [] and free_slots(pool) == 4
            assert (await fetch(pool))[2] == b"ok"
            return server.connections

    assert asyncio.run(main()) == 2


def test_an_upstream_that_stops_reading_the_body_is_a_write_timeout():
    def wedged(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            await asyncio.sleep(30)  # reads nothing

        return handler

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"x" * 65536

    async def main(content: object):
        async with raw(wedged) as server:
            pool = UpstreamPool(server.url, 4)
            started = time.monotonic()
            with pytest.raises(httpx.WriteTimeout):
                await fetch(pool, b"POST", content, timeouts={**TIMEOUTS, "write": 0.3})
            assert free_slots(pool) == 4 and pool._idle == []
            return time.monotonic() - started

    assert asyncio.run(main(endless())) < 5
    assert asyncio.run(main(b"x" * 20_000_000)) < 5  # a body in memory: its drain is timed


def test_a_client_gone_mid_upload_aborts_the_upstream_request():
    class Gone(Exception):
        pass

    closed = asyncio.Event()

    def reader_of_all(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            await reader.read()  # until the client aborts
            closed.set()

        return handler

    async def going() -> AsyncIterator[bytes]:
        yield b"part"
        raise Gone

    async def main():
        async with raw(reader_of_all) as server:
            pool = UpstreamPool(server.url, 4)
            with pytest.raises(Gone):
                await fetch(pool, b"POST", going())
            await asyncio.wait_for(closed.wait(), 2)
            assert free_slots(pool) == 4 and pool._idle == []

    asyncio.run(main())


def silent(server: RawServer) -> Handler:
    async def handler(reader, writer, n):
        await server.read(reader)
        await reader.read()  # never answers; returns when the client closes

    return handler


def test_no_answer_within_the_read_timeout_is_a_read_timeout():
    async def main():
        async with raw(silent) as server:
            pool = UpstreamPool(server.url, 4)
            with pytest.raises(httpx.ReadTimeout):
                await fetch(pool, timeouts={**TIMEOUTS, "read": 0.2})
            assert free_slots(pool) == 4 and pool._idle == []

    asyncio.run(main())


def test_the_read_timeout_is_between_two_reads_not_in_total():
    def trickle(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            await server.read(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n")
            for byte in b"abc":  # 0.75 s in all, 0.25 s apart: within a 0.5 s read timeout
                await asyncio.sleep(0.25)
                writer.write(bytes([byte]))
            await reader.read()  # then stalls one byte short

        return handler

    async def main():
        async with raw(trickle) as server:
            pool = UpstreamPool(server.url, 4)
            response = await pool.request(
                b"GET", b"/", [(b"host", b"up")], None, {**TIMEOUTS, "read": 0.5}
            )
            got = b""
            with pytest.raises(httpx.ReadTimeout):
                async for chunk in response.iter_chunks():
                    got += chunk
            await response.aclose()
            assert free_slots(pool) == 4 and pool._idle == []
            return got

    assert asyncio.run(main()) == b"abc"


def test_a_cancelled_request_closes_its_connection_and_returns_its_slot():
    async def main():
        async with raw(silent) as server:
            pool = UpstreamPool(server.url, 1)
            task = asyncio.ensure_future(fetch(pool))
            await until(lambda: len(server.heads) == 1)  # sent, waiting for the head
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert free_slots(pool) == 1 and pool._idle == []
            await until(lambda: server.closed == 1)  # the upstream sees the request gone
            return server.connections, len(server.heads)

    assert asyncio.run(main()) == (1, 1)


def test_a_response_closed_mid_body_returns_its_slot_and_closes_its_connection():
    def half(server: RawServer) -> Handler:
        async def handler(reader, writer, n):
            await server.read(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
            await reader.read()

        return handler

    async def main():
        async with raw(half) as server:
            pool = UpstreamPool(server.url, 1)
            response = await pool.request(b"GET", b"/", [(b"host", b"up")], None, TIMEOUTS)
            assert free_slots(pool) == 0
            async for chunk in response.iter_chunks():
                assert chunk == b"half"
                break
            await response.aclose()
            await response.aclose()  # twice is once
            assert free_slots(pool) == 1 and pool._idle == []

    asyncio.run(main())


def test_a_full_pool_is_a_pool_timeout():
    async def main():
        async with raw(silent) as server:
            pool = UpstreamPool(server.url, 1)
            task = asyncio.ensure_future(fetch(pool))
            await asyncio.sleep(0.1)
            with pytest.raises(httpx.PoolTimeout):
                await fetch(pool, timeouts={**TIMEOUTS, "pool": 0.1})
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert free_slots(pool) == 1

    asyncio.run(main())


def test_a_refused_connection_is_a_connect_error():
    async def main():
        pool = UpstreamPool(httpx.URL(f"http://127.0.0.1:{free_port()}"), 1)
        with pytest.raises(httpx.ConnectError) as caught:
            await fetch(pool)
        assert free_slots(pool) == 1
        # The readiness probe names the reason from the OS's error.
        assert isinstance(caught.value.__cause__.os_error, ConnectionRefusedError)

    asyncio.run(main())


@pytest.mark.skipif(not hasattr(asyncio, "timeout"), reason="3.10 has only wait_for")
def test_a_cancel_that_arrives_as_the_connection_is_made_is_not_lost():
    """asyncio.wait_for (3.11) returns the inner result when the cancel and the result
    meet; connect() would then hand a connection to an exchange already called off."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        made = loop.create_future()

        class HeldOpen:  # the loop as connect() sees it, its connection made by the test
            def __getattr__(self, name: str) -> object:
                return getattr(loop, name)

            async def create_connection(self, *args: object, **kwargs: object) -> object:
                return await made

        task = asyncio.ensure_future(http1_module.connect(HeldOpen(), "up", 80, None, 10))
        for _ in range(3):
            await asyncio.sleep(0)
        made.set_result((None, http1_module.Connection(loop)))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_connection_never_accepted_is_a_connect_timeout():
    # A listener whose backlog is full: the kernel drops further SYNs, so connect hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
        fillers.append(filler)

    async def main():
        pool = UpstreamPool(httpx.URL(f"http://127.0.0.1:{listener.getsockname()[1]}"), 1)
        with pytest.raises(httpx.ConnectTimeout):
            await fetch(pool, timeouts={**TIMEOUTS, "connect": 0.3})
        assert free_slots(pool) == 1

    try:
        asyncio.run(main())
    finally:
        for sock in [*fillers, listener]:
            sock.close()


def test_the_httpx_transport_protocol_reads_and_closes():
    async def main():
        async with raw(answering(OK_EMPTY, OK_EMPTY)) as server:
            pool = UpstreamPool(server.url, 2)
            async with httpx.AsyncClient(transport=pool, base_url=str(server.url)) as client:
                first = await client.get("/health?full=1")
                second = await client.post("/v1", content=b"{}")
            assert (first.status_code, first.text, second.text) == (200, "ok", "ok")
            assert server.heads[0].startswith(b"GET /health?full=1 HTTP/1.1\r\n")
            assert server.bodies[1] == b"{}"
            return server.connections

    assert asyncio.run(main()) == 1
