"""HTTP/1.1 framing against ``modalgate serve`` as a process, over raw sockets.

Each case is bytes a hostile or broken client sends: request smuggling (Content-Length
with Transfer-Encoding, two Content-Lengths, obfuscated Transfer-Encoding), chunk
extensions, bare LF, obs-fold, pipelining with a refused request second, Expect:
100-continue, absolute-form targets, path spellings, slow clients, head and body
limits. Behind the gateway a recording upstream; the request the gate must refuse is
a video to ``kimi-k3`` (image only). Every case must get an answer or a close within
its time (no hang), no 5xx, and the upstream must never receive the video.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from conftest import MP4_BYTES, chat, data_url, serve
from gateway_proc import GatewayProcess
from toy_upstream import ToyUpstream

VIDEO = orjson.dumps(
    chat({"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}})
)
TEXT = orjson.dumps(chat())
HOST = b"Host: gate\r\n"
QUIET_S = 1.5


def post(body: bytes, path: bytes = b"/v1/chat/completions", extra: bytes = b"") -> bytes:
    head = b"POST " + path + b" HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
    return head + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


def chunked(body: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n0\r\n\r\n" % (len(body), extension, body)


SMUGGLED = post(VIDEO)
CASES: dict[str, bytes] = {
    "CL and TE: the chunk holds a video request": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(TEXT)
        + chunked(TEXT)
        + SMUGGLED
    ),
    "TE and CL, TE first": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
        + chunked(VIDEO)
    ),
    "two Content-Lengths": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(TEXT), len(VIDEO))
        + VIDEO
    ),
    "Content-Length with a sign": post(VIDEO, extra=b"Content-Length: +%d\r\n" % len(VIDEO)),
    "TE: xchunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding: xchunked\r\n\r\n"
        + chunked(VIDEO)
    ),
    "TE: chunked, identity": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding: chunked, identity\r\n\r\n"
        + chunked(VIDEO)
    ),
    "TE with a space before the colon": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding : chunked\r\n\r\n"
        + chunked(VIDEO)
    ),
    "TE folded onto the next line": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding:\r\n chunked\r\n\r\n"
        + chunked(VIDEO)
    ),
    "chunk extensions": (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunked(VIDEO, b";name=value;x")
    ),
    "bare LF line ends": (
        b"POST /v1/chat/completions HTTP/1.1\n"
        + b"Host: gate\n"
        + b"Content-Length: %d\n\n" % len(VIDEO)
        + VIDEO
    ),
    "obs-fold in a header": post(VIDEO, extra=b"X-Folded: a\r\n b\r\n"),
    "pipelined: text, then a video": post(TEXT) + SMUGGLED,
    "Expect: 100-continue": post(VIDEO, extra=b"Expect: 100-continue\r\n"),
    "absolute-form target": post(VIDEO, path=b"http://gate/v1/chat/completions"),
    "path: //": post(VIDEO, path=b"//v1//chat/completions"),
    "path: dot segments": post(VIDEO, path=b"/v1/./x/../chat/completions"),
    "path: trailing slash": post(VIDEO, path=b"/v1/chat/completions/"),
    "path: encoded slash": post(VIDEO, path=b"/v1%2Fchat%2Fcompletions"),
    "path: a query": post(VIDEO, path=b"/v1/chat/completions?stream=true"),
    "head over the limit": post(VIDEO, extra=b"X-Long: " + b"a" * 70_000 + b"\r\n"),
    "body over the cap": post(orjson.dumps(chat({"type": "text", "text": "x" * 3_000_000}))),
    "a NUL in a header": post(VIDEO, extra=b"X-Nul: a\x00b\r\n"),
    "HTTP/1.0 with a body": post(VIDEO).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
}


@pytest.fixture(scope="module")
def upstream() -> Iterator[ToyUpstream]:
    toy = ToyUpstream("toy")
    with serve(toy.app()) as url:
        toy.url = url  # type: ignore[attr-defined]
        yield toy


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory) -> Iterator[GatewayProcess]:
    policy = tmp_path_factory.mktemp("framing") / "policy.yaml"
    policy.write_text("extends: builtin\nlimits: {max_body_bytes: 2000000}\n")
    flags = ("--upstream", upstream.url, "--policy", str(policy), "--no-access-log")
    flags += ("--client-header-timeout", "2", "--client-timeout", "2")
    with GatewayProcess(*flags) as process:
        yield process


def exchange(port: int, data: bytes, pause: float = 0.0, limit_s: float = 10.0) -> bytes:
    """Send ``data`` (in two halves ``pause`` apart), then read what comes back until the
    gateway closes, or has been quiet for ``QUIET_S`` after answering; a gateway that
    neither answers nor closes within ``limit_s`` fails the test (a hang)."""
    with socket.create_connection(("127.0.0.1", port), timeout=QUIET_S) as client:
        half = len(data) // 2 if pause else len(data)
        client.sendall(data[:half])
        if pause:
            time.sleep(pause)
            with contextlib.suppress(OSError):  # it may have answered and closed already
                client.sendall(data[half:])
        received, deadline = b"", time.monotonic() + limit_s
        while True:
            try:
                chunk = client.recv(65536)
            except ConnectionResetError:
                return received
            except TimeoutError:
                if received:
                    return received  # answered, and the connection kept alive
                if time.monotonic() > deadline:
                    raise AssertionError(f"no answer and no close within {limit_s} s") from None
                continue
            if not chunk:
                return received
            received += chunk


def statuses(raw: bytes) -> list[int]:
    """Each response's status (a response may follow a body on the same line)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.[01] (\d{3}) ", raw)]


def videos_received(toy: ToyUpstream) -> int:
    return sum(b"video_url" in r.body for r in toy.received)


@pytest.mark.parametrize("name", list(CASES))
def test_no_framing_gets_a_refused_request_past_the_gate(gateway, upstream, name):
    upstream.received.clear()
    answer = exchange(gateway.port, CASES[name])
    codes = statuses(answer)
    assert all(code < 500 for code in codes), (name, codes, answer[:300])
    assert videos_received(upstream) == 0, name
    if name == "pipelined: text, then a video":
        assert codes[:2] == [200, 400]
        assert len(upstream.received) == 1
    if name.startswith("path: ") or name in ("absolute-form target", "Expect: 100-continue"):
        assert codes[-1] in (400, 404), (name, codes)


@pytest.mark.parametrize(
    ("name", "code"),
    [("head over the limit", 431), ("body over the cap", 413), ("two Content-Lengths", 400)],
)
def test_limits_and_ambiguity_are_answered_with_their_codes(gateway, upstream, name, code):
    assert statuses(exchange(gateway.port, CASES[name]))[0] == code


def test_a_client_that_stalls_mid_head_is_answered_408_not_held(gateway, upstream):
    upstream.received.clear()
    raw = exchange(gateway.port, SMUGGLED, pause=3.0)
    assert statuses(raw)[:1] == [408]
    assert videos_received(upstream) == 0


def test_the_gateway_serves_on_after_every_case(gateway):
    answer = httpx.post(gateway.url + "/v1/chat/completions", content=TEXT, timeout=10)
    assert answer.status_code == 200
    assert "Traceback" not in gateway.text()
