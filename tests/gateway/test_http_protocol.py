"""``modalgate serve``'s uvicorn protocol: request bodies of a declared length reach the
app whole; writes of one loop turn leave as one.

A real uvicorn server (in a thread) with the protocol, real sockets; the real
transport under the protocol's is wrapped to count its writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import uvicorn
import uvloop

from conftest import serve
from modalgate.gateway.http import body_reader
from modalgate.gateway.http import protocol as http_protocol
from modalgate.gateway.http.body_reader import WholeBodyReader, as_bytes, writable_bytes
from modalgate.gateway.http.connection import FLUSH_AT_BYTES, CoalescingTransport
from modalgate.gateway.http.protocol import ON_CLIENT_GONE, ServeHttpProtocol

WRITES: list[int] = []  # sizes of the real transport's writes, in order
GO_ON = threading.Event()
FIRST_PART_IN = threading.Event()  # the app took a part of a body with more to come
DISCONNECTED = threading.Event()
CALLED_BACK: list[str] = []
SLOW_S = 0.4  # how long /slow takes to answer


class _CountingTransport:
    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(len(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CountingProtocol(ServeHttpProtocol):
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
    elif path == "/echo":  # the sizes of the body's messages, and its digest
        sizes, body = await _read_body(receive)
        if sizes is None:
            return
        answer = json.dumps({"sizes": sizes, "sha256": hashlib.sha256(body).hexdigest()})
        headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer.encode()})
    elif path in ("/kept", "/forgotten"):  # a callback for the client's going away
        forget = scope["extensions"][ON_CLIENT_GONE](lambda: CALLED_BACK.append(path))
        if path == "/forgotten":
            forget()
        headers.append((b"content-length", b"2"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/slow":  # answers late (SLOW_S, or ?for=S), without reading a body
        query = scope["query_string"].decode()
        await asyncio.sleep(float(query.partition("=")[2]) if query else SLOW_S)
        headers.append((b"content-length", b"4"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"slow"})
    elif path == "/close":
        headers += [(b"connection", b"close"), (b"content-length", b"3")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"bye"})


async def _read_body(receive) -> tuple[list[int] | None, bytes]:
    sizes: list[int] = []
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            DISCONNECTED.set()
            return None, body
        sizes.append(len(message["body"]))
        body += message["body"]
        if not message.get("more_body", False):
            return sizes, body
        FIRST_PART_IN.set()


def _serving(protocol: Any, **config: Any) -> Iterator[int]:
    """A real uvicorn server with ``protocol`` on 127.0.0.1; yields its port."""
    with serve(app, http=protocol, **config) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    yield from _serving(CountingProtocol)


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


def _post(length: int, extra: str = "") -> bytes:
    return f"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: {length}\r\n{extra}\r\n".encode()


def _echoed(sock: socket.socket) -> dict:
    response = _read_response(sock, b"}")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n"), response[:200]
    return json.loads(response.partition(b"\r\n\r\n")[2])


def _send_in_pieces(sock: socket.socket, body: bytes, pieces: int) -> None:
    """Sent with pauses, so the server reads the body in several parts."""
    step = -(-len(body) // pieces)
    for at in range(0, len(body), step):
        sock.sendall(body[at : at + step])
        time.sleep(0.02)


def test_a_body_of_declared_length_reaches_the_app_whole(server):
    body = bytes(range(256)) * 4000  # ~1 MB
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(len(body)))
        _send_in_pieces(sock, body, 8)
        echoed = _echoed(sock)
        assert echoed == {"sizes": [len(body)], "sha256": hashlib.sha256(body).hexdigest()}
        sock.sendall(_post(3) + b"abc")  # the next request on the connection: the same
        assert _echoed(sock)["sizes"] == [3]


READERS: list[WholeBodyReader] = []


class _SeenReader(WholeBodyReader):
    def __init__(self, *args: Any) -> None:
        READERS.append(self)
        super().__init__(*args)


@pytest.fixture
def readers(monkeypatch) -> list[WholeBodyReader]:
    """The in-place body readers made while the test runs."""
    READERS.clear()
    monkeypatch.setattr(http_protocol, "WholeBodyReader", _SeenReader)
    return READERS


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def any_loop_server(request) -> Iterator[int]:
    """uvloop picks a protocol's read callbacks when reading starts; asyncio at each read."""
    yield from _serving(CountingProtocol, loop=request.param)


@pytest.mark.parametrize("pieces", [1, 7])
def test_the_rest_of_a_big_body_is_read_in_place(any_loop_server, readers, pieces):
    """Past the header read, the body goes straight into its bytes object, and the
    protocol is put back for the next request on the connection."""
    body = bytes(range(256)) * 3000 + b"end"
    with socket.create_connection(("127.0.0.1", any_loop_server)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(len(body)) + body[:10])
        time.sleep(0.05)
        _send_in_pieces(sock, body[10:], pieces)
        assert _echoed(sock) == {"sizes": [len(body)], "sha256": hashlib.sha256(body).hexdigest()}
        sock.sendall(_post(3) + b"abc")
        assert _echoed(sock)["sizes"] == [3]
        assert len(readers) == 1
        assert readers[0].transport.get_protocol() is readers[0].owner
        # uvloop keeps the reader's bound methods after the swap back: it holds no body.
        assert len(readers[0]._body) == 0 and readers[0]._view.nbytes == 0


def test_a_small_rest_of_a_body_is_not_read_in_place(server, readers):
    body = b"y" * (http_protocol.IN_PLACE_MIN_BYTES - 1)
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(len(body)))
        time.sleep(0.05)
        sock.sendall(body)
        assert _echoed(sock)["sizes"] == [len(body)]
    assert readers == []


def test_writable_bytes_are_bytes_filled_in_place():
    body, view = writable_bytes(6)
    view[:3] = b"abc"
    view[3:] = b"def"
    assert type(body) is bytes and body == b"abcdef" and hash(body) == hash(b"abcdef")
    made = [writable_bytes(1000)[0] for _ in range(3)]
    assert len({id(one) for one in made}) == 3  # fresh objects, not shared ones
    with pytest.raises(ValueError):
        writable_bytes(1)  # CPython shares its one-byte objects


def test_the_view_of_writable_bytes_keeps_them_alive():
    body, view = writable_bytes(64)
    before = sys.getrefcount(body)
    del view
    assert sys.getrefcount(body) == before - 1  # the view held a reference to it


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_swap_leaves_paused_reading_paused(loop_factory):
    """Swapped while reading is paused (flow control), the transport stays paused, and
    the reader reads once reading resumes."""

    async def main() -> tuple[bool, bytes]:
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        owner = asyncio.Protocol()
        transport, _ = await loop.connect_accepted_socket(lambda: owner, ours)
        transport.pause_reading()
        got: list[bytes] = []
        reader = WholeBodyReader(owner, transport, [b"ab"], 6, lambda: None, got.append)
        theirs.sendall(b"cdef")
        await asyncio.sleep(0.05)
        paused = not transport.is_reading() and not got
        assert transport.get_protocol() is reader
        transport.resume_reading()
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        assert transport.get_protocol() is owner and transport.is_reading()
        transport.close()
        theirs.close()
        return paused, got[0]

    loop = loop_factory()
    try:
        assert loop.run_until_complete(main()) == (True, b"abcdef")
    finally:
        loop.close()


def test_writable_bytes_elsewhere_are_a_bytearray_copied_once(monkeypatch):
    monkeypatch.setattr(body_reader, "_CPYTHON", False)
    body, view = writable_bytes(4)
    view[:] = b"wxyz"
    assert type(body) is bytearray and as_bytes(body) == b"wxyz"


def test_a_request_after_a_whole_body_in_the_same_read_is_parsed_afresh(server):
    """The rest of a whole body is read past the HTTP parser; the request pipelined
    behind it (in the same read as the body's end) is parsed as any other."""
    first, second = bytes(range(256)) * 400, b'{"second": true}'
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(len(first)) + first[:1000])
        time.sleep(0.05)
        sock.sendall(first[1000:50_000])
        time.sleep(0.05)
        sock.sendall(first[50_000:] + _post(len(second)) + second)
        answers = b""
        while answers.count(b"}") < 2:
            answers += sock.recv(65536)
    echoed = [json.loads(a.partition(b"\r\n\r\n")[2] + b"}") for a in answers.split(b"}")[:2]]
    assert echoed == [
        {"sizes": [len(first)], "sha256": hashlib.sha256(first).hexdigest()},
        {"sizes": [len(second)], "sha256": hashlib.sha256(second).hexdigest()},
    ]


def test_the_rest_of_a_body_answered_early_is_dropped_and_the_next_request_read(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 30000\r\n\r\n")
        assert _read_response(sock, b"hello").startswith(b"HTTP/1.1 200 OK\r\n")
        sock.sendall(b"GET" * 5000)  # not a request: the rest of the body
        time.sleep(0.05)
        sock.sendall(b"GET" * 5000 + _post(3) + b"abc")
        assert _echoed(sock)["sizes"] == [3]


def test_a_body_without_a_length_is_handed_over_as_it_arrives(server):
    """Chunked: the client may be streaming as it goes, so the app gets the first part
    before the client has sent the rest."""
    FIRST_PART_IN.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        head = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        sock.sendall(head + b"5\r\nfirst\r\n")
        assert FIRST_PART_IN.wait(5)
        sock.sendall(b"4\r\nlast\r\n0\r\n\r\n")
        echoed = _echoed(sock)
    assert echoed["sizes"][0] == 5 and sum(echoed["sizes"]) == 9
    assert echoed["sha256"] == hashlib.sha256(b"firstlast").hexdigest()


def test_a_body_over_the_whole_size_is_handed_over_in_parts(server, monkeypatch):
    monkeypatch.setattr(http_protocol, "WHOLE_BODY_BYTES", 100_000)
    body = bytes(range(256)) * 1200  # 307,200 bytes
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(len(body)))
        _send_in_pieces(sock, body, 6)
        echoed = _echoed(sock)
    assert len(echoed["sizes"]) > 1 and sum(echoed["sizes"]) == len(body)
    assert echoed["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_client_gone_before_its_body_is_whole_is_a_disconnect(server):
    """The app waiting for a held body hears the disconnect: no request hangs."""
    DISCONNECTED.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(_post(1_000_000) + b"x" * 10_000)
        time.sleep(0.1)
    assert DISCONNECTED.wait(5)


def test_expect_100_continue_with_a_whole_body(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(5, "expect: 100-continue\r\n"))
        assert _read_response(sock, b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        assert _echoed(sock) == {"sizes": [5], "sha256": hashlib.sha256(b"hello").hexdigest()}


def test_the_client_going_away_calls_back_unless_the_callback_was_forgotten(server):
    CALLED_BACK.clear()
    for path in ("/forgotten", "/kept"):
        with socket.create_connection(("127.0.0.1", server)) as sock:
            sock.settimeout(5)
            sock.sendall(_request(path))
            assert _read_response(sock, b"ok").startswith(b"HTTP/1.1 200 OK\r\n")
    deadline = time.monotonic() + 5
    while not CALLED_BACK and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # time for a wrong call to arrive too
    assert CALLED_BACK == ["/kept"]


def test_a_callback_given_after_the_client_went_is_called_at_once():
    """As ``receive`` answers ``http.disconnect`` at once on a lost connection."""

    async def main() -> list[str]:
        called: list[str] = []
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(app, lifespan="off")
        config.load()
        state = uvicorn.server.ServerState()
        protocol = ServeHttpProtocol(config=config, server_state=state, app_state={})
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, ours)
        theirs.sendall(_request("/kept"))
        await asyncio.sleep(0.05)
        call_when_gone = protocol.scope["extensions"][ON_CLIENT_GONE]
        theirs.close()
        await asyncio.sleep(0.05)
        call_when_gone(lambda: called.append("late"))
        await asyncio.sleep(0)
        transport.close()
        return called

    assert asyncio.run(main()) == ["late"]


# ---------------------------------------------------------------- a client gone silent

READ_TIMEOUT_S = 0.5
MAX_HEADER_BYTES = 4096


@pytest.fixture(scope="module")
def impatient() -> Iterator[int]:
    """The protocol with a short read timeout, and a keep-alive far longer than it."""
    protocol = partial(
        CountingProtocol, read_timeout_s=READ_TIMEOUT_S, max_header_bytes=MAX_HEADER_BYTES
    )
    yield from _serving(protocol, timeout_keep_alive=30)


def _until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    started = time.monotonic()
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - started


def _timed_out(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 408 Request Timeout", response[:200]
    assert b"connection: close" in lines and b"content-type: application/json" in lines
    assert f"content-length: {len(body)}".encode() in lines
    return json.loads(body)["error"]


TIMED_OUT = {
    "message": "the request did not arrive in full: nothing came for 0.5 s",
    "type": "invalid_request_error",
    "param": None,
    "code": "request_timeout",
}


def test_a_body_that_stops_arriving_is_answered_408_and_the_app_hears_a_disconnect(impatient):
    DISCONNECTED.clear()
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(1000) + b"x" * 100)
        response, waited = _until_closed(sock)
    error = _timed_out(response)
    assert {key: error[key] for key in TIMED_OUT} == TIMED_OUT
    assert READ_TIMEOUT_S * 0.8 < waited < READ_TIMEOUT_S + 2
    assert DISCONNECTED.wait(5)  # the app waiting for the body is let go


def test_a_body_read_in_place_that_stops_arriving_is_answered_408(impatient, readers):
    DISCONNECTED.clear()
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(500_000) + b"x" * 100)
        time.sleep(0.05)
        for _ in range(3):  # slow, but arriving: no timeout
            sock.sendall(b"x" * 50_000)
            time.sleep(READ_TIMEOUT_S / 2)
        response, waited = _until_closed(sock)
    assert len(readers) == 1
    error = _timed_out(response)
    assert {key: error[key] for key in TIMED_OUT} == TIMED_OUT
    assert READ_TIMEOUT_S * 0.3 < waited < READ_TIMEOUT_S + 2
    assert DISCONNECTED.wait(5)


def test_headers_that_stop_arriving_are_answered_408(impatient):
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-le")
        response, _ = _until_closed(sock)
    assert _timed_out(response)["code"] == "request_timeout"


def test_a_slow_client_that_keeps_sending_is_not_timed_out(impatient):
    """The timeout is the longest silence, not the time the whole request takes."""
    body = b"0123456789" * 2
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\n")
        time.sleep(READ_TIMEOUT_S * 0.6)
        sock.sendall(f"content-length: {len(body)}\r\n\r\n".encode())
        for at in range(0, len(body), 4):  # 1.5 s in all, three times the timeout
            time.sleep(READ_TIMEOUT_S * 0.6)
            sock.sendall(body[at : at + 4])
        assert _echoed(sock) == {"sizes": [len(body)], "sha256": hashlib.sha256(body).hexdigest()}


def test_a_kept_alive_connection_between_requests_is_left_to_the_keep_alive_timeout(impatient):
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(3) + b"abc")
        assert _echoed(sock)["sizes"] == [3]
        time.sleep(READ_TIMEOUT_S * 3)  # idle, between requests: no 408
        sock.sendall(_post(3) + b"def")
        assert _echoed(sock)["sizes"] == [3]


def test_a_connection_that_never_sends_a_request_is_closed_without_an_answer(impatient):
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        response, waited = _until_closed(sock)
    assert response == b"" and waited < READ_TIMEOUT_S + 2


def test_a_request_answered_before_its_body_is_in_gets_no_408_after_its_answer(impatient):
    """The app answered without reading the body; the client then goes silent: the
    connection is closed, with the app's answer the only one sent."""
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\nabc")
        response, _ = _until_closed(sock)
    assert response.startswith(b"HTTP/1.1 200 OK\r\n") and response.endswith(b"hello")
    assert b"408" not in response


# ---------------------------------------------------------------- a head without end


def _head_refused(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 431 Request Header Fields Too Large", response[:200]
    assert b"connection: close" in lines
    return json.loads(body)["error"]


@pytest.mark.parametrize(
    "header_lines",
    [
        [b"x-pad-%d: %s\r\n" % (i, b"a" * 90) for i in range(60)],  # many headers
        [b"x-pad: " + b"a" * 1500] * 4,  # one header value that goes on and on
        [b"b" * 1500] * 4,  # the request target
    ],
    ids=["many headers", "one long header", "long target"],
)
def test_a_head_over_the_limit_is_answered_431_as_it_arrives(impatient, header_lines):
    first = b"POST /echo HTTP/1.1\r\nhost: t\r\n"
    if header_lines[0].startswith(b"b"):
        first = b"POST /echo?"
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(first)
        for line in header_lines:  # in pieces, as the server reads them
            time.sleep(0.01)
            with contextlib.suppress(OSError):  # the server may have answered and closed
                sock.sendall(line)
        response, waited = _until_closed(sock)
    error = _head_refused(response)
    assert error == {
        "message": "the request line and headers are larger than 4096 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "headers_too_large",
        "violations": [
            {
                "code": "headers_too_large",
                "message": "the request line and headers are larger than 4096 bytes",
                "param": None,
            }
        ],
    }
    assert waited < READ_TIMEOUT_S  # refused for its size, not timed out


def test_a_head_just_under_the_limit_is_served(impatient):
    padding = b"x-pad: " + b"a" * (MAX_HEADER_BYTES - 200) + b"\r\n"
    with socket.create_connection(("127.0.0.1", impatient)) as sock:
        sock.settimeout(5)
        sock.sendall(_post(3, padding.decode()) + b"abc")
        assert _echoed(sock)["sizes"] == [3]
        sock.sendall(_post(3, padding.decode()) + b"def")  # and the next one on the connection
        assert _echoed(sock)["sizes"] == [3]


# ---------------------------------------------------------------- each head measured exactly

LIMIT = 300  # bytes of request line and headers


@pytest.fixture(scope="module")
def measured() -> Iterator[int]:
    """The protocol with a small head limit and no deadline a test here could reach."""
    protocol = partial(CountingProtocol, read_timeout_s=10, max_header_bytes=LIMIT)
    yield from _serving(protocol)


def _head_of(size: int, length: int, path: str = "/echo") -> bytes:
    """A POST head of exactly ``size`` bytes (padded with a header)."""
    start = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {length}\r\n"
    pad = size - len(start) - len("x-pad: \r\n\r\n")
    head = (start + "x-pad: " + "a" * pad + "\r\n\r\n").encode()
    assert len(head) == size
    return head


def _sent_in_reads(sock: socket.socket, data: bytes, cuts: list[int]) -> None:
    """``data`` cut at ``cuts``, each piece its own write, with a pause after it so
    that the server reads it alone."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    at = 0
    for cut in [*cuts, len(data)]:
        with contextlib.suppress(OSError):  # refused and closed meanwhile
            sock.sendall(data[at:cut])
        at = cut
        time.sleep(0.005 if len(cuts) > 50 else 0.03)


def _answers(data: bytes) -> list[tuple[bytes, bytes]]:
    """(status line, body) of each response in ``data``, all with a content-length."""
    answers = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(line[16:]) for line in lines if line.startswith(b"content-length: "))
        if len(rest) < length:
            raise ValueError("a response not in full yet")
        answers.append((lines[0], rest[:length]))
        data = rest[length:]
    return answers


def _read_answers(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """The first ``count`` responses on ``sock`` (the connection left open)."""
    data = b""
    while True:
        with contextlib.suppress(StopIteration, ValueError):
            answers = _answers(data)
            if len(answers) >= count:
                return answers
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk


def _echo(body: bytes) -> tuple[bytes, bytes]:
    answer = json.dumps({"sizes": [len(body)], "sha256": hashlib.sha256(body).hexdigest()})
    return b"HTTP/1.1 200 OK", answer.encode()


FIRST_BODY = bytes(range(256)) * 2  # more than LIMIT: were it counted as a head, a 431
SECOND_BODY = b"second"


def _two_requests(second_head_size: int) -> tuple[bytes, int, int]:
    """A request with a body longer than the head limit, then one whose head is
    ``second_head_size`` bytes; and where the first's body and the second's head start."""
    first = _head_of(200, len(FIRST_BODY))
    second = _head_of(second_head_size, len(SECOND_BODY))
    stream = first + FIRST_BODY + second + SECOND_BODY
    return stream, len(first), len(first) + len(FIRST_BODY)


SPLITS = {
    # the second head shares a read with the first's body, then the rest of it
    "behind a body": lambda body_at, head_at, size: [body_at, head_at + size - 10],
    "one write": lambda body_at, head_at, size: [],
    "byte by byte": lambda body_at, head_at, size: list(range(head_at, head_at + size + 1)),
    # the head's CRLF CRLF cut in two, each part behind other bytes
    "end cut after CR": lambda body_at, head_at, size: [head_at + 5, head_at + size - 1],
    "end cut after CRLF": lambda body_at, head_at, size: [head_at - 1, head_at + size - 2],
    "end cut after CRLF CR": lambda body_at, head_at, size: [head_at + size - 3],
    "every 7 bytes": lambda body_at, head_at, size: list(range(7, head_at + size + 7, 7)),
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("over", [0, 1], ids=["at the limit", "one byte over"])
def test_each_head_is_measured_exactly_however_the_reads_fall(measured, split, over):
    """A head of exactly the limit is served and one a byte longer refused, whether it
    comes in one read, a byte at a time, cut inside its final CRLF CRLF, or in a read
    behind a body longer than the limit; the request before it is answered either way."""
    stream, body_at, head_at = _two_requests(LIMIT + over)
    with socket.create_connection(("127.0.0.1", measured)) as sock:
        sock.settimeout(5)
        _sent_in_reads(sock, stream, SPLITS[split](body_at, head_at, LIMIT + over))
        answers = _answers(_until_closed(sock)[0]) if over else _read_answers(sock, 2)
    assert answers[0] == _echo(FIRST_BODY)
    if over:
        assert answers[1][0] == b"HTTP/1.1 431 Request Header Fields Too Large"
        assert json.loads(answers[1][1])["error"]["code"] == "headers_too_large"
        assert len(answers) == 2
    else:
        assert answers == [_echo(FIRST_BODY), _echo(SECOND_BODY)]


def _chunked(body: bytes, path: str = "/echo") -> bytes:
    """A chunked request: ``body`` in two chunks, and a trailer."""
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    half = len(body) // 2
    chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n" % (half, body[:half], len(body) - half, body[half:])
    return head + chunks + b"0\r\nx-trailer: yes\r\n\r\n"


@pytest.mark.parametrize("cut", [0, 1, 2, 3], ids=lambda cut: f"end cut {cut} from its end")
def test_a_head_behind_a_chunked_body_is_measured_from_the_body_s_end(measured, cut):
    """A chunked body ends at a CRLF CRLF (after its trailers), which its chunks may
    hold too; the head after it, in the same read, counts from its own first byte."""
    body = b"\r\n\r\n" * 100  # the end of a chunked body, many times over, as data
    first = _chunked(body)
    second = _head_of(LIMIT, len(SECOND_BODY))
    stream = first + second + SECOND_BODY
    at = len(first) - cut  # where the first read ends
    cuts = [at, len(first) + LIMIT - 5] if cut else [len(first) + LIMIT - 5]
    with socket.create_connection(("127.0.0.1", measured)) as sock:
        sock.settimeout(5)
        _sent_in_reads(sock, stream, cuts)
        (status, first_echo), second_answer = _read_answers(sock, 2)
    echoed = json.loads(first_echo)  # a chunked body is handed over as it comes
    assert status == b"HTTP/1.1 200 OK" and sum(echoed["sizes"]) == len(body)
    assert echoed["sha256"] == hashlib.sha256(body).hexdigest()
    assert second_answer == _echo(SECOND_BODY)


def _after_a_slow_answer(port: int, refused: bytes) -> tuple[bytes, bytes]:
    """``refused`` pipelined behind a request the app answers slowly: that answer must go
    out whole first, then the refusal, then the close. The refusal's status line and body."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(_request("/slow") + refused)
        response, waited = _until_closed(sock)
    answers = _answers(response)
    assert answers[0] == (b"HTTP/1.1 200 OK", b"slow")
    assert len(answers) == 2 and waited > SLOW_S * 0.8
    return answers[1]


def test_the_answer_to_a_request_before_a_refused_head_is_sent_first(measured):
    """Pipelined: the app is still answering the first request when the second's head
    passes the limit. The first's answer goes out, then the 431, then the close."""
    status, _ = _after_a_slow_answer(measured, _head_of(LIMIT + 200, 3) + b"abc")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"


# ---------------------------------------------------------------- deadlines for a head and a body

SILENCE_S = 0.6
HEAD_S = 0.6
BODY_S = 0.6
RATE = 2000  # bytes of body a second that earn a second


@pytest.fixture(scope="module")
def deadlines() -> Iterator[int]:
    protocol = partial(
        CountingProtocol,
        read_timeout_s=SILENCE_S,
        head_timeout_s=HEAD_S,
        body_timeout_s=BODY_S,
        body_min_rate=RATE,
    )
    yield from _serving(protocol, timeout_keep_alive=30)


def _dribbled(sock: socket.socket, data: bytes, every_s: float) -> None:
    """A byte at a time, never silent for long, until sent or refused."""
    with contextlib.suppress(OSError):
        for at in range(len(data)):
            sock.sendall(data[at : at + 1])
            time.sleep(every_s)


def _dribbling(sock: socket.socket, data: bytes, every_s: float) -> threading.Thread:
    thread = threading.Thread(target=_dribbled, args=(sock, data, every_s), daemon=True)
    thread.start()
    return thread


def test_a_head_dribbled_without_silence_is_answered_408_at_its_deadline(deadlines):
    with socket.create_connection(("127.0.0.1", deadlines)) as sock:
        sock.settimeout(5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _dribbling(sock, _head_of(200, 3), SILENCE_S / 6)  # 200 bytes: 20 s at this pace
        response, waited = _until_closed(sock)
    error = _timed_out(response)
    assert error["code"] == "request_timeout"
    assert error["message"] == "the request line and headers did not arrive in full within 0.6 s"
    assert HEAD_S * 0.8 < waited < HEAD_S + 1.5


def test_a_body_trickled_without_silence_is_answered_408_at_its_deadline(deadlines):
    DISCONNECTED.clear()
    with socket.create_connection(("127.0.0.1", deadlines)) as sock:
        sock.settimeout(5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_post(1000))
        _dribbling(sock, b"x" * 1000, SILENCE_S / 6)  # 10 bytes a second: far under RATE
        response, waited = _until_closed(sock)
    error = _timed_out(response)
    assert error["message"] == (
        "the request body did not arrive in time: 0.6 s, and 1 s more for every 2000 bytes received"
    )
    assert BODY_S * 0.8 < waited < BODY_S + 1.5
    assert DISCONNECTED.wait(5)  # the app waiting for the body is let go


@pytest.mark.parametrize("length", [20_000, 300_000], ids=["read by the protocol", "in place"])
def test_a_body_that_keeps_up_the_rate_may_take_longer_than_the_deadline(
    deadlines, readers, length
):
    """Each RATE bytes received earn a second: a body arriving at twice the rate is
    never cut off, however long it takes in all (here over twice BODY_S)."""
    body = bytes(range(256)) * (length // 256)
    pieces = 8
    step = len(body) // pieces
    pause = max(step / (2 * RATE), BODY_S / 3)  # at least twice the rate, in all
    pause = min(pause, BODY_S * 0.3)  # and never silent for long
    with socket.create_connection(("127.0.0.1", deadlines)) as sock:
        sock.settimeout(10)
        sock.sendall(_post(len(body)) + body[:step])
        started = time.monotonic()
        for at in range(step, len(body), step):
            time.sleep(pause)
            sock.sendall(body[at : at + step])
        echoed = _echoed(sock)
    assert time.monotonic() - started > BODY_S * 2
    assert echoed == {"sizes": [len(body)], "sha256": hashlib.sha256(body).hexdigest()}
    assert len(readers) == (length > 2 * http_protocol.IN_PLACE_MIN_BYTES)


def test_a_chunked_body_earns_time_by_what_has_come(deadlines):
    head = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = b"y" * 800  # 800 bytes each BODY_S / 3: 2,000 a second
    with socket.create_connection(("127.0.0.1", deadlines)) as sock:
        sock.settimeout(10)
        sock.sendall(head)
        for _ in range(6):  # 1.2 s in all, twice BODY_S
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(BODY_S / 3)
        sock.sendall(b"0\r\n\r\n")
        echoed = _echoed(sock)
    assert sum(echoed["sizes"]) == 6 * len(chunk)


def test_time_a_request_waits_for_its_turn_is_not_held_against_its_client(deadlines):
    """Pipelined behind a slow answer, the second request's reading is paused by the
    server: its client cannot send meanwhile, so neither clock runs for it; once its
    turn comes, it has the whole of each again."""
    slow = f"GET /slow?for={SLOW_S * 4} HTTP/1.1\r\nhost: t\r\n\r\n".encode()
    second = _post(10) + b"abc"
    with socket.create_connection(("127.0.0.1", deadlines)) as sock:
        sock.settimeout(10)
        sock.sendall(slow + second)
        first = _read_response(sock, b"slow")
        time.sleep(SILENCE_S / 3)  # a client in no hurry: it takes its time to go on
        sock.sendall(b"defghij")  # the rest of the second body, once the first is answered
        echoed = _echoed(sock)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert echoed == {"sizes": [10], "sha256": hashlib.sha256(b"abcdefghij").hexdigest()}


def test_a_deadline_for_a_head_behind_a_slow_answer_waits_for_that_answer(deadlines):
    """The head pipelined behind the slow request passes its deadline while the app is
    still answering: the answer goes out first, then the 408."""
    slow = f"GET /slow?for={SLOW_S * 4} HTTP/1.1\r\nhost: t\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", deadlines)) as sock:
        sock.settimeout(10)
        sock.sendall(slow + b"POST /echo HTTP/1.1\r\nhost: t\r\n")
        response, waited = _until_closed(sock)
    answers = _answers(response)
    assert answers[0] == (b"HTTP/1.1 200 OK", b"slow")
    assert answers[1][0] == b"HTTP/1.1 408 Request Timeout"
    assert json.loads(answers[1][1])["error"]["code"] == "request_timeout"
    assert len(answers) == 2 and waited > SLOW_S * 4 * 0.8


# ---------------------------------------------------------------- bytes that are not HTTP/1.1


class RefusalCountingApp:
    """The app with ``protocol_refused``, as ``modalgate serve``'s gateway offers it."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        await app(scope, receive, send)

    def protocol_refused(self, violation) -> None:
        self.refused.append(str(violation.code))


@pytest.fixture(scope="module")
def counted() -> Iterator[tuple[int, RefusalCountingApp]]:
    counting = RefusalCountingApp()
    with serve(counting, http=ServeHttpProtocol, proxy_headers=False) as url:  # unwrapped
        yield int(url.rsplit(":", 1)[1]), counting


def _malformed(response: bytes) -> str:
    """The message of a 400 for bytes llhttp refused; the connection closed after it."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 Bad Request", response[:200]
    assert b"connection: close" in lines and b"content-type: application/json" in lines
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_request" and error["param"] is None
    assert error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"content-length: 1\r\ncontent-length: 2\r\n", "Duplicate Content-Length"),
        (b"ho st: t\r\n", "Invalid header token"),
    ],
    ids=["two lengths", "a space in a name"],
)
def test_a_head_llhttp_refuses_is_answered_400_in_the_envelope_and_counted(counted, head, reason):
    port, counting = counted
    counting.refused.clear()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\n" + head + b"\r\nab")
        response, _ = _until_closed(sock)
    assert _malformed(response) == f"the request is not valid HTTP/1.1: {reason}"
    assert counting.refused == ["invalid_request"]


def test_a_malformed_head_pipelined_behind_a_request_waits_for_its_answer(server):
    """The client reads its answers in order: the first request's, then the 400."""
    status, _ = _after_a_slow_answer(server, b"GET / HTTP/1.1\r\nho st: t\r\n\r\n")
    assert status == b"HTTP/1.1 400 Bad Request"


def test_a_malformed_chunk_is_answered_400_at_once_and_the_app_hears_a_disconnect(server):
    """The app is waiting for the rest of the body: it hears ``http.disconnect``."""
    DISCONNECTED.clear()
    FIRST_PART_IN.clear()
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        head = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        sock.sendall(head + b"a\r\nfirst part\r\n")
        assert FIRST_PART_IN.wait(5)
        sock.sendall(b"zz\r\n")
        response, _ = _until_closed(sock)
    assert (
        _malformed(response) == "the request is not valid HTTP/1.1: Invalid character in chunk size"
    )
    assert DISCONNECTED.wait(5)


def test_an_upgrade_is_answered_as_http_and_the_connection_closed_after_it(server):
    """No websocket or h2c here: what follows the Upgrade request is not read."""
    upgrade = (
        b"GET /small HTTP/1.1\r\nhost: t\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
        b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(5)
        sock.sendall(upgrade + _request("/small"))
        response, _ = _until_closed(sock)
    answers = _answers(response)
    assert answers == [(b"HTTP/1.1 200 OK", b"hello")]
    assert b"connection: close" in response.split(b"\r\n\r\n")[0].split(b"\r\n")


def test_a_malformed_chunk_of_a_pipelined_request_is_answered_in_its_turn(server):
    """The request before it is still being answered: that answer goes out whole, then
    the 400, then the close; the refused request never reaches the app."""
    DISCONNECTED.clear()
    head = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    status, body = _after_a_slow_answer(server, head + b"a\r\nfirst part\r\nzz\r\n")
    assert status == b"HTTP/1.1 400 Bad Request"
    error = json.loads(body)["error"]
    assert error["message"] == "the request is not valid HTTP/1.1: Invalid character in chunk size"
    assert not DISCONNECTED.is_set()  # /echo never ran
