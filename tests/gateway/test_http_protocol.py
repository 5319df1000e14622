"""``modalgate serve``'s uvicorn protocol: writes of one loop turn leave as one.

A real uvicorn server (in a thread) with the protocol, real sockets; the real
transport under the protocol's is wrapped to count its writes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from conftest import free_port
from modalgate.gateway.http_protocol import FLUSH_AT_BYTES, CoalescingHttpToolsProtocol

WRITES: list[int] = []  # sizes of the real transport's writes, in order
GO_ON = threading.Event()


class _CountingTransport:
    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(len(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CountingProtocol(CoalescingHttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport.transport = _CountingTransport(transport)  # type: ignore[attr-defined]


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    headers = [(b"content-type", b"text/plain")]
    if path == "/small":
        headers.append((b"content-length", b"5"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"hello"})
    elif path == "/stream":  # an event, then a wait on the test: the first must be out
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.get_running_loop().run_in_executor(None, GO_ON.wait, 10)
        await send({"type": "http.response.body", "body": b"data: 2\n\n"})
    elif path == "/big":
        chunk = b"x" * 40_000
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(10):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"end"})
    elif path == "/close":
        headers += [(b"connection", b"close"), (b"content-length", b"3")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"bye"})


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=CountingProtocol, log_level="warning", lifespan="off"
    )
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not instance.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield port
    instance.should_exit = True
    thread.join(10)


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode()


def _read_response(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_small_response_is_one_write(server):
    WRITES.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        for _ in range(3):  # keep-alive: each response its own single write
            sock.sendall(_request("/small"))
            response = _read_response(sock, b"hello")
            assert response.startswith(b"HTTP/1.1 200 OK\r\n")
            assert response.endswith(b"content-length: 5\r\n\r\nhello")
    assert len(WRITES) == 3, WRITES


def test_a_stream_is_not_held_back(server):
    """The first event leaves while the app still waits: nothing waits for a later turn
    than the one that wrote it."""
    WRITES.clear()
    GO_ON.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_request("/stream"))
        first = _read_response(sock, b"data: 1\n\n\r\n")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"transfer-encoding: chunked" in first
        GO_ON.set()
        rest = _read_response(sock, b"0\r\n\r\n")
    assert rest == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    assert len(WRITES) == 2, WRITES  # head + event 1, then event 2 + the end


def test_big_bodies_are_not_held_past_the_flush_size(server):
    WRITES.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_request("/big"))
        response = _read_response(sock, b"0\r\n\r\n")
    _, _, body = response.partition(b"\r\n\r\n")
    assert body.count(b"x") == 400_000 and body.endswith(b"3\r\nend\r\n0\r\n\r\n")
    assert max(WRITES) < FLUSH_AT_BYTES + 40_100
    assert len(WRITES) >= 400_000 // (FLUSH_AT_BYTES + 40_100)


def test_connection_close_sends_everything_first(server):
    WRITES.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_request("/close"))
        response = _read_response(sock, b"never")  # read to EOF: the server closed
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert response.endswith(b"\r\n\r\nbye")
    assert len(WRITES) == 1


def test_pipelined_requests_are_answered_in_order(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_request("/small") + _request("/close"))
        data = _read_response(sock, b"never")
    first, _, second = data.partition(b"hello")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert second.startswith(b"HTTP/1.1 200 OK\r\n") and second.endswith(b"bye")


def test_held_bytes_go_before_the_end_of_writing():
    """``write_eof`` in the turn that wrote: the bytes first, then the end (a real socket)."""
    from modalgate.gateway.http_protocol import CoalescingTransport

    async def main() -> bytes:
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        coalescing = CoalescingTransport(transport, loop)
        coalescing.write(b"held ")
        coalescing.write(b"bytes")
        coalescing.write_eof()
        theirs.setblocking(False)
        received = b""
        while True:
            chunk = await loop.sock_recv(theirs, 1024)
            if not chunk:
                break
            received += chunk
        transport.close()
        theirs.close()
        return received

    assert asyncio.run(main()) == b"held bytes"
