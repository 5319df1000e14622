"""The proxy's upstream client against upstreams that misbehave at the HTTP level, and over TLS.

A real ``modalgate serve`` process in front of raw-socket servers written here
(no HTTP library on that side, so each fault is exactly the bytes it says), and
in front of the toy upstream under uvicorn with a certificate from a test CA.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import trustme
import uvicorn

from conftest import chat, serve
from gateway_proc import GatewayProcess, metric
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
