"""Slow clients (slowloris) against a real ``modalgate serve``: connections that trickle
a request and go silent are answered 408 and closed once ``--client-timeout`` passes,
and hold nothing up meanwhile; a head or body that keeps trickling is answered 408 at
its own deadline; a head sent without end is answered 431 at its limit, each head
counted by its own bytes however they fall into reads."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from conftest import chat, serve
from gateway_proc import GatewayProcess, metric
from toy_upstream import ToyUpstream

TIMEOUT_S = 1.0
HELD = 60  # of each kind


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


def _stalled(port: int, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(first_bytes)
    sock.setblocking(False)
    return sock


def _until_all_closed(socks: list[socket.socket], deadline_s: float) -> dict[int, bytes]:
    """What each socket received before the gateway closed it (all closed by the deadline)."""
    received: dict[int, bytes] = {id(sock): b"" for sock in socks}
    open_ = set(socks)
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + deadline_s
        while open_ and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                sock = key.fileobj
                chunk = sock.recv(65536)  # type: ignore[union-attr]
                if chunk:
                    received[id(sock)] += chunk
                else:
                    selector.unregister(sock)
                    open_.discard(sock)  # type: ignore[arg-type]
    assert not open_, f"{len(open_)} stalled connections still open after {deadline_s} s"
    return received


def test_stalled_connections_hold_nothing_up_and_are_closed_with_408(upstream):
    toy, base = upstream
    body = orjson.dumps(chat())
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body) + 50}\r\n\r\n"
    ).encode()
    with GatewayProcess("--upstream", base, "--client-timeout", str(TIMEOUT_S)) as gateway:
        toy.received.clear()
        started = time.monotonic()
        mid_headers = [_stalled(gateway.port, head[:40]) for _ in range(HELD)]
        mid_body = [_stalled(gateway.port, head + body) for _ in range(HELD)]
        try:
            # Meanwhile an ordinary request goes through at once.
            answer = httpx.post(gateway.url + "/v1/chat/completions", content=body, timeout=5)
            assert answer.status_code == 200
            assert time.monotonic() - started < TIMEOUT_S
            received = _until_all_closed(mid_headers + mid_body, TIMEOUT_S + 5)
        finally:
            for sock in mid_headers + mid_body:
                sock.close()
    for sock in mid_headers + mid_body:
        assert received[id(sock)].startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        error = orjson.loads(received[id(sock)].partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout"
    # Only the ordinary request reached the upstream.
    assert [r.path for r in toy.received if r.method == "POST"] == ["/v1/chat/completions"]


def test_a_head_without_end_is_answered_431_and_the_gateway_keeps_its_memory(upstream):
    toy, base = upstream
    with GatewayProcess("--upstream", base, "--max-header-bytes", "8192") as gateway:
        before = _rss_kib(gateway.process.pid)
        toy.received.clear()
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.settimeout(10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n")
            line = b"x-pad: " + b"a" * 1000 + b"\r\n"
            with contextlib.suppress(OSError):  # refused and closed while sending
                for _ in range(20_000):  # 20 MB of header lines, were they all taken
                    sock.sendall(line)
            response = b""
            with contextlib.suppress(OSError):
                while chunk := sock.recv(65536):
                    response += chunk
        assert response.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        error = orjson.loads(response.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "headers_too_large"
        assert error["message"] == "the request line and headers are larger than 8192 bytes"
        assert _rss_kib(gateway.process.pid) - before < 8 * 1024  # not the 20 MB sent
        line = gateway.wait_for_log(lambda r: r.get("event") == "client_headers_too_large")
        assert (line["status"], line["code"]) == (431, "headers_too_large")
        rejected = {"outcome": "rejected", "code": "headers_too_large", "model": "unknown"}
        assert metric(gateway, "modalgate_requests_total", **rejected) == 1
        assert httpx.post(gateway.url + "/v1/chat/completions", json=chat()).status_code == 200
    assert [r.path for r in toy.received if r.method == "POST"] == ["/v1/chat/completions"]


def test_a_refusal_reaches_a_client_still_sending(upstream):
    """The 431 goes and the gateway's side is shut, then it reads and drops what still
    comes before it closes. Closed at once with bytes unread (the rest of one big
    send), the kernel sends an RST instead of the end: the client reads a reset, and
    the answer, where it was not read yet, is lost."""
    _, base = upstream
    with GatewayProcess("--upstream", base, "--max-header-bytes", "8192") as gateway:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
                sock.settimeout(10)
                head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nx-pad: "
                sending = threading.Thread(
                    target=_send_quietly, args=(sock, head + b"a" * 4_000_000), daemon=True
                )
                sending.start()
                response = b""
                while chunk := sock.recv(65536):  # the answer, then the end: no reset
                    response += chunk
                sending.join(10)
            assert response.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _chat_request(size: int, path: str = "/v1/chat/completions") -> bytes:
    """A chat request of ``size`` bytes in all (its JSON padded with blanks), as bytes."""
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    body = orjson.dumps(chat())
    length_line = "content-length: %d\r\n\r\n"
    body_size = size - len(head) - len(length_line % 0) - 2  # a length of 3 or 4 digits
    body_size -= len(str(body_size)) - 1
    request = (head + length_line % body_size).encode() + body.ljust(body_size)
    return request


def _answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """(status, body) of the next ``count`` responses, each with a content-length."""
    data, answers = b"", []
    while len(answers) < count:
        head, found, rest = data.partition(b"\r\n\r\n")
        if found:
            lines = head.split(b"\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in lines
                if line.lower().startswith(b"content-length:")
            )
            if len(rest) >= length:
                answers.append((int(lines[0].split()[1]), rest[:length]))
                data = rest[length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, (answers, data)
        data += chunk
    return answers


def test_the_header_limit_counts_each_head_not_each_read(upstream):
    """A head over the limit sent in one write is refused; a small head sharing a read
    with the body of the request before it is not taken for part of a long one."""
    toy, base = upstream
    with GatewayProcess("--upstream", base, "--max-header-bytes", "8192") as gateway:
        toy.received.clear()
        padding = "x-pad: " + "a" * 14 * 1024 + "\r\n"
        big = _chat_request(16 * 1024).replace(b"host: t\r\n", f"host: t\r\n{padding}".encode())
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.settimeout(10)
            sock.sendall(big)  # one write: a head of over 14 KiB
            ((status, body),) = _answers(sock, 1)
        assert status == 431 and orjson.loads(body)["error"]["code"] == "headers_too_large"
        first, second = _chat_request(10_300), _chat_request(400)
        head_end = first.index(b"\r\n\r\n") + 4
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.settimeout(10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(first[:head_end])
            time.sleep(0.1)
            sock.sendall(first[head_end:] + second)  # a 10 KB body, then the next request
            answers = _answers(sock, 2)
        assert [status for status, _ in answers] == [200, 200]
    assert [r.path for r in toy.received if r.method == "POST"] == ["/v1/chat/completions"] * 2


def _dribble(sock: socket.socket, data: bytes, every_s: float) -> None:
    with contextlib.suppress(OSError):  # answered and closed meanwhile
        for at in range(len(data)):
            sock.sendall(data[at : at + 1])
            time.sleep(every_s)


def _dribbled(port: int, start: bytes, rest: bytes, every_s: float) -> tuple[bytes, float]:
    """``start`` at once, then ``rest`` a byte every ``every_s``: what came back, and
    how long after the dribbling began the gateway closed the connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(start)
        started = time.monotonic()
        threading.Thread(target=_dribble, args=(sock, rest, every_s), daemon=True).start()
        received = _until_all_closed([sock], 15)[id(sock)]
    return received, time.monotonic() - started


def _timed_out(received: bytes) -> str:
    assert received.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), received[:200]
    assert b"connection: close" in received.partition(b"\r\n\r\n")[0].split(b"\r\n")
    error = orjson.loads(received.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    return error["message"]


def test_a_head_dribbled_without_a_pause_is_cut_at_its_deadline(upstream):
    """A byte every 0.2 s: never silent for the client timeout (60 s), so only the
    head's own deadline ends it."""
    toy, base = upstream
    with GatewayProcess("--upstream", base, "--client-header-timeout", "1") as gateway:
        toy.received.clear()
        received, waited = _dribbled(gateway.port, b"P", _chat_request(2000)[1:], 0.2)
        assert _timed_out(received) == (
            "the request line and headers did not arrive in full within 1 s"
        )
        assert 0.7 < waited < 4
        line = gateway.wait_for_log(lambda r: r.get("event") == "client_timed_out")
        assert (line["status"], line["code"]) == (408, "request_timeout")
        rejected = {"outcome": "rejected", "code": "request_timeout", "model": "unknown"}
        assert metric(gateway, "modalgate_requests_total", **rejected) == 1
    assert not [r for r in toy.received if r.method == "POST"]


def test_a_body_trickled_under_the_rate_is_cut_and_one_at_the_rate_is_not(upstream):
    """MODALGATE_CLIENT_BODY_TIMEOUT_S=1 and MODALGATE_CLIENT_BODY_MIN_RATE=2000: a body
    may take 1 s, and 1 s more for every 2,000 bytes that have come."""
    toy, base = upstream
    env = {"MODALGATE_CLIENT_BODY_TIMEOUT_S": "1", "MODALGATE_CLIENT_BODY_MIN_RATE": "2000"}
    with GatewayProcess("--upstream", base, env=env) as gateway:
        toy.received.clear()
        request = _chat_request(3000)
        head_end = request.index(b"\r\n\r\n") + 4
        # 5 bytes a second: never silent, far under the rate.
        received, waited = _dribbled(gateway.port, request[:head_end], request[head_end:], 0.2)
        assert _timed_out(received) == (
            "the request body did not arrive in time: 1 s, and 1 s more for every 2000 bytes"
            " received"
        )
        assert 0.7 < waited < 4
        # 3,000 bytes a second, for longer than 1 s in all: never cut off.
        request = _chat_request(8000)
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.settimeout(10)
            started = time.monotonic()
            for at in range(0, len(request), 600):
                sock.sendall(request[at : at + 600])
                time.sleep(0.2)
            ((status, _),) = _answers(sock, 1)
        assert status == 200 and time.monotonic() - started > 2
    assert [r.path for r in toy.received if r.method == "POST"] == ["/v1/chat/completions"]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")
