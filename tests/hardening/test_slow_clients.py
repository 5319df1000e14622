"""Slow clients (slowloris) against a real ``modalgate serve``: connections that trickle
a request and go silent are answered 408 and closed once ``--client-timeout`` passes,
and hold nothing up meanwhile; a head sent without end is answered 431 at its limit."""

from __future__ import annotations

import contextlib
import selectors
import socket
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


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")
