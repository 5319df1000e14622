"""``modalgate serve --upstream``: the official openai client -> a real gateway process -> a
real upstream (Starlette, SSE with delays) in this process, recording what it receives."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from pydantic import TypeAdapter

from conftest import chat, data_url, free_port, image_bytes, objects_left_behind, serve
from gateway_proc import GatewayProcess, metric, raw_http
from modalgate.gateway.app import create_app
from modalgate.gateway.http.protocol import ServeHttpProtocol
from modalgate.gateway.upstream.proxy import _Exchange
from modalgate.policy import parse_policy
from modalgate.policy.models import DEFAULT_ENDPOINTS
from modalgate.policy.surface import EndpointSpec
from modalgate.settings import GatewaySettings
from toy_upstream import Behaviour, ToyUpstream

HOP_BY_HOP_SENT = {"te": "trailers", "keep-alive": "timeout=5", "x-drop-me": "1"}

# The default surface and the toy's /echo paths, as a policy file spells them.
ECHO_ENDPOINTS = TypeAdapter(dict[str, EndpointSpec]).dump_python(
    {**DEFAULT_ENDPOINTS, "/echo/*": "forward"}, mode="json"
)


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


@pytest.fixture
def toy(upstream) -> ToyUpstream:
    toy, _ = upstream
    toy.behaviour = Behaviour()
    toy.received.clear()
    toy.token_sent_at.clear()
    toy.streams_cancelled = toy.streams_finished = 0
    return toy


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory) -> Iterator[GatewayProcess]:
    _, base = upstream
    # The toy's /echo paths join the forwarded API surface; everything else stays default.
    policy = tmp_path_factory.mktemp("policy") / "echo.json"
    policy.write_bytes(orjson.dumps({"extends": "builtin", "endpoints": ECHO_ENDPOINTS}))
    with GatewayProcess(
        "--upstream", base, "--upstream-read-timeout", "2", "--policy", str(policy)
    ) as process:
        yield process


def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test", max_retries=0)


USER = [{"role": "user", "content": "hello"}]


def test_non_streaming_reaches_upstream_with_the_original_bytes(gateway, toy):
    raw = orjson.dumps(chat({"type": "image_url", "image_url": {"url": data_url(image_bytes())}}))
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=raw,
        headers={
            "content-type": "application/json",
            "authorization": "Bearer sk-1",
            "x-custom": "yes",
            **HOP_BY_HOP_SENT,
            "connection": "keep-alive, x-drop-me",
        },
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == f"toy saw {len(raw)} bytes"
    assert response.headers["x-upstream-own"] == "kept"
    (received,) = toy.received
    assert received.body == raw
    assert received.headers["authorization"] == "Bearer sk-1"
    assert received.headers["x-custom"] == "yes"
    for name in ("te", "keep-alive", "x-drop-me"):
        assert name not in received.headers
    assert received.headers["x-forwarded-for"] == "127.0.0.1"
    assert received.headers["host"] == httpx.URL(gateway_upstream(toy, gateway)).netloc.decode()


def gateway_upstream(toy: ToyUpstream, gateway: GatewayProcess) -> str:
    command = gateway.process.args
    return command[command.index("--upstream") + 1]


def test_openai_client_non_streaming(gateway, toy):
    completion = client(gateway).chat.completions.create(model="kimi-k3", messages=USER)
    assert completion.choices[0].message.content.startswith("toy saw ")
    assert toy.received[0].json()["messages"] == USER


def test_stream_first_chunk_arrives_before_the_last_token_is_sent(gateway, toy):
    toy.behaviour = Behaviour(tokens=5, token_delay_s=0.3)
    stream = client(gateway).chat.completions.create(model="kimi-k3", messages=USER, stream=True)
    arrivals, texts = [], []
    for chunk in stream:
        arrivals.append(time.monotonic())
        texts.append(chunk.choices[0].delta.content)
    assert texts == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
    assert len(toy.token_sent_at) == 5
    # Not buffered: the client holds the first token before the upstream has sent the last.
    assert arrivals[0] < toy.token_sent_at[-1]


def test_refused_request_never_reaches_upstream(gateway, toy):
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).chat.completions.create(
            model="kimi-k3",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
                    ],
                }
            ],
        )
    assert caught.value.code == "unsupported_modality"
    assert caught.value.param == "messages.[0].content.[0].type"
    assert toy.received == []


def test_upstream_error_passes_through_unchanged(gateway, toy):
    toy.behaviour = Behaviour(status=422)
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=chat({"type": "text", "text": "hi"})
    )
    assert response.status_code == 422
    assert response.json() == {
        "object": "error",
        "message": "upstream says no",
        "type": "BadRequestError",
        "param": None,
        "code": 422,
    }
    assert response.headers["x-upstream-own"] == "kept"


def test_other_paths_are_proxied_as_they_are(gateway, toy):
    models = httpx.get(gateway.url + "/v1/models")
    assert models.json()["data"][0]["id"] == "toy"
    put = httpx.put(gateway.url + "/echo/a/b?x=1&y=%20z", content=b"12345")
    assert put.status_code == 201
    assert put.json() == {"method": "PUT", "path": "/echo/a/b", "query": "x=1&y=%20z", "bytes": 5}
    assert httpx.delete(gateway.url + "/echo/gone").json()["method"] == "DELETE"
    # /v1/models is the gateway's own: the upstream's list was read at start, and cached.
    assert [r.path for r in toy.received if r.path != "/v1/models"] == ["/echo/a/b", "/echo/gone"]


def test_upstream_sees_only_the_clients_headers_and_ours(gateway, toy):
    answer = raw_http(
        gateway,
        b"POST /echo/plain HTTP/1.1\r\nHost: gw.test\r\nContent-Length: 3\r\n"
        b"Connection: close\r\n\r\nabc",
    )
    assert answer.startswith(b"HTTP/1.1 200 ")
    (received,) = toy.received
    assert received.body == b"abc"
    # No Accept, Accept-Encoding, User-Agent or Content-Type of the proxy's own.
    assert sorted(name for name, _ in received.raw_headers) == [
        "content-length",
        "host",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-request-id",
    ]
    assert received.headers["x-forwarded-host"] == "gw.test"


def test_paths_are_forwarded_normalised_and_queries_unchanged(gateway, toy):
    # The upstream reads the path the gate judged: dot segments resolved, %2F decoded.
    answer = raw_http(
        gateway,
        b"GET /echo/a%2Fb/./c//d%20e?x=%20&y=a+b HTTP/1.1\r\nHost: gw.test\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200 ")
    (received,) = toy.received
    assert received.raw_path == b"/echo/a/b/c/d%20e"
    assert received.query == "x=%20&y=a+b"


def test_paths_off_the_api_surface_are_not_forwarded(gateway, toy):
    for method, where in [("POST", "/flush_cache"), ("POST", "/update_weights_from_disk")]:
        response = httpx.request(method, gateway.url + where, json={})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert toy.received == []


def test_chunked_request_body_is_forwarded_whole(gateway, toy):
    parts = [bytes([65 + i]) * 100_000 for i in range(3)]
    response = httpx.put(gateway.url + "/echo/chunked", content=iter(parts))
    assert response.status_code == 201
    assert response.json()["bytes"] == 300_000
    (received,) = toy.received
    assert received.body == b"".join(parts)
    assert received.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in received.headers


def test_one_users_cookies_never_reach_another_user(gateway, toy):
    first = httpx.get(gateway.url + "/echo/login?setcookie=1")
    assert first.cookies["upstream_session"] == "secret-of-one-user"  # passed to its client
    httpx.get(gateway.url + "/echo/next")
    assert "cookie" not in toy.received[1].headers


def test_upstream_slow_gives_504(gateway, toy):
    toy.behaviour = Behaviour(headers_delay_s=3.5)
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="kimi-k3", messages=USER)
    assert caught.value.status_code == 504
    assert caught.value.body["code"] == "upstream_timeout"
    assert "2 s" in caught.value.body["message"]


def test_upstream_reset_mid_stream_is_an_error_event(gateway, toy):
    toy.behaviour = Behaviour(tokens=5, reset_after=2)
    stream = client(gateway).chat.completions.create(model="kimi-k3", messages=USER, stream=True)
    texts = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
    assert texts == ["t0 ", "t1 "]
    assert caught.value.body["code"] == "upstream_unavailable"
    assert "mid-response" in caught.value.message


def test_client_disconnect_cancels_the_upstream_stream(gateway, toy):
    toy.behaviour = Behaviour(tokens=20, token_delay_s=0.2)
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        json=chat({"type": "text", "text": "hi"}, stream=True),
    ) as response:
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    deadline = time.monotonic() + 5
    while toy.streams_cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert toy.streams_cancelled == 1
    assert len(toy.token_sent_at) < 20


def test_client_disconnect_before_the_answer_closes_the_upstream_request(gateway, toy):
    """A non-streamed completion: the client gives up while the server is still thinking."""
    toy.behaviour = Behaviour(headers_delay_s=1.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway.url + "/v1/chat/completions",
            json=chat({"type": "text", "text": "hi"}),
            headers={"x-request-id": "gives-up-early"},
            timeout=httpx.Timeout(5, read=0.3),
        )
    line = gateway.wait_for_log(
        lambda r: r.get("request_id") == "gives-up-early" and r.get("logger") == "modalgate.proxy"
    )
    assert line["event"] == "client disconnected; upstream request closed"
    access = gateway.wait_for_log(
        lambda r: r.get("request_id") == "gives-up-early" and r.get("event") == "access"
    )
    assert access["status"] == 499  # the client closed first: no 500 for its going away


@pytest.mark.parametrize("protocol", ["httptools", "serve"])
def test_the_disconnect_is_heard_under_serves_protocol_and_under_plain_uvicorn(
    upstream, toy, protocol, monkeypatch
):
    """serve's protocol calls back when the client goes (no watcher task); plain uvicorn
    has no such callback, and a task waiting on ``receive`` hears it instead. Either way
    the abandoned upstream stream is closed."""
    watchers: list[object] = []
    real_watch = _Exchange._watch

    async def counted_watch(self) -> None:
        watchers.append(self)
        await real_watch(self)

    monkeypatch.setattr(_Exchange, "_watch", counted_watch)
    _, base = upstream
    app = create_app(settings=GatewaySettings(upstream=base))
    http = ServeHttpProtocol if protocol == "serve" else "httptools"
    toy.behaviour = Behaviour(tokens=20, token_delay_s=0.2)
    request = chat({"type": "text", "text": "hi"}, stream=True)
    with serve(app, http=http) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=request) as response:
            assert next(response.iter_raw()).startswith(b"data: ")
        deadline = time.monotonic() + 5
        while toy.streams_cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert toy.streams_cancelled == 1 and len(toy.token_sent_at) < 20
    assert len(watchers) == (0 if protocol == "serve" else 1)


VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}


@pytest.mark.parametrize("protocol", ["serve", "httptools"])
@pytest.mark.parametrize(
    ("request_parts", "extra", "status"),
    [
        ([{"type": "text", "text": "hi"}], {}, 200),
        ([{"type": "text", "text": "hi"}], {"stream": True}, 200),
        ([VIDEO], {}, 400),
    ],
    ids=["answered", "streamed", "refused"],
)
def test_a_finished_request_leaves_nothing_for_the_garbage_collector(
    upstream, toy, protocol, request_parts, extra, status
):
    """Every request's objects are freed when it ends, by reference counting: an exchange
    left in a reference cycle keeps its scope, headers and closures until a collection
    runs, and collections then run every few requests (~11% of serve's CPU per text
    request, ``benchmarks/ab_serve.py``)."""
    _, base = upstream
    app = create_app(settings=GatewaySettings(upstream=base))
    http = ServeHttpProtocol if protocol == "serve" else "httptools"
    toy.behaviour = Behaviour(tokens=2)
    request = chat(*request_parts, **extra)

    def answered() -> None:
        assert http_client.post("/v1/chat/completions", json=request).status_code == status

    with serve(app, http=http) as url, httpx.Client(base_url=url) as http_client:
        left = objects_left_behind(answered)
    assert left == Counter()


@pytest.mark.parametrize(("protocol", "started_while_stalled"), [("serve", 0), ("httptools", 1)])
def test_a_stalled_upload_of_declared_length_reaches_the_upstream_only_when_whole(
    protocol, started_while_stalled
):
    """serve's protocol holds a body of declared length until it is whole, so a client
    that stops half way ties up its own connection only, not an upstream one; plain
    uvicorn hands the first part on, and a forwarded path opens the upstream request."""
    toy = ToyUpstream()
    arrived: list[str] = []
    inner = toy.app()

    async def counting(scope, receive, send) -> None:
        if scope["type"] == "http":
            arrived.append(scope["path"])  # the request's head, before its body
        await inner(scope, receive, send)

    body = b"x" * 200_000
    head = (
        "POST /echo/upload HTTP/1.1\r\nhost: gw\r\n"
        f"content-type: application/octet-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    policy = {"extends": "builtin", "endpoints": ECHO_ENDPOINTS}
    with serve(counting) as upstream_url:
        settings = GatewaySettings(upstream=upstream_url)
        app = create_app(parse_policy(orjson.dumps(policy).decode(), fmt="json"), settings=settings)
        http = ServeHttpProtocol if protocol == "serve" else "httptools"
        with serve(app, http=http) as url:
            arrived.clear()  # the gateway's look at /v1/models at start
            address = httpx.URL(url)
            with socket.create_connection((address.host, address.port), timeout=10) as sock:
                sock.sendall(head + body[:100_000])
                time.sleep(0.5)
                stalled = [path for path in arrived if path == "/echo/upload"]
                sock.sendall(body[100_000:])
                answer = b""
                while not answer.endswith(b"}") and (chunk := sock.recv(65536)):
                    answer += chunk
    assert len(stalled) == started_while_stalled
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert toy.received[-1].body == body


def test_request_id_round_trips(gateway, toy):
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=chat({"type": "text", "text": "hi"}),
        headers={"x-request-id": "req-42.a"},
    )
    assert response.headers.get_list("x-request-id") == ["req-42.a"]
    assert toy.received[0].headers["x-request-id"] == "req-42.a"
    made = httpx.post(
        gateway.url + "/v1/chat/completions", json=chat({"type": "text", "text": "hi"})
    )
    generated = made.headers["x-request-id"]
    assert len(generated) == 32
    assert toy.received[1].headers["x-request-id"] == generated
    refused = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
        headers={"x-request-id": "bad id with spaces"},
    )
    assert refused.status_code == 400
    new_id = refused.headers["x-request-id"]
    assert new_id != "bad id with spaces"
    line = gateway.wait_for_log(
        lambda r: r.get("event") == "request_rejected" and r.get("request_id") == new_id
    )
    assert line["code"] == "unsupported_modality"
    assert line["model"] == "kimi-k3"


def test_metrics_count_what_happened(upstream):
    toy, base = upstream
    toy.behaviour = Behaviour()
    with GatewayProcess("--upstream", base) as gateway:
        openai_client = client(gateway)
        openai_client.chat.completions.create(model="kimi-k3", messages=USER)
        openai_client.chat.completions.create(model="kimi-k3", messages=USER)
        for _ in range(3):
            with pytest.raises(openai.BadRequestError):
                openai_client.chat.completions.create(
                    model="kimi-k3",
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "video_url", "video_url": {"url": "https://e.com/v.mp4"}}
                            ],
                        }
                    ],
                )
        assert metric(gateway, "modalgate_requests_total", outcome="accepted", model="kimi-k3") == 2
        assert (
            metric(
                gateway,
                "modalgate_requests_total",
                outcome="rejected",
                code="unsupported_modality",
                model="kimi-k3",
            )
            == 3
        )
        assert metric(gateway, "modalgate_validation_seconds_count") == 5
        assert metric(gateway, "modalgate_upstream_seconds_count", status_class="2xx") == 2
        # A model no rule names is counted under "unknown", not under its own name.
        openai_client.chat.completions.create(model="my-private-model-123", messages=USER)
        assert metric(gateway, "modalgate_requests_total", model="unknown") == 1


@pytest.fixture
def wedged_upstream() -> Iterator[str]:
    """A server whose kernel accepts connections but which never reads a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for sock in [*held, listener]:
            sock.close()


def test_upstream_that_stops_reading_the_body_gives_504(wedged_upstream):
    # 20 MB is more than loopback's socket buffers hold, so the write must stall.
    body = orjson.dumps(chat({"type": "text", "text": "x" * 20_000_000}))
    with GatewayProcess("--upstream", wedged_upstream, "--upstream-write-timeout", "1") as gateway:
        started = time.monotonic()
        response = httpx.post(
            gateway.url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        elapsed = time.monotonic() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout"
    assert error["message"] == "the upstream did not take the request body within 1 s"
    assert elapsed < 30  # the write timeout, not the 300 s read timeout


def test_upstream_down_gives_502_and_readyz_says_so():
    dead = f"http://127.0.0.1:{free_port()}"
    with GatewayProcess("--upstream", dead) as gateway:
        with pytest.raises(openai.APIStatusError) as caught:
            client(gateway).chat.completions.create(model="kimi-k3", messages=USER)
        assert caught.value.status_code == 502
        assert caught.value.body["code"] == "upstream_unavailable"
        assert caught.value.body["type"] == "server_error"
        ready = httpx.get(gateway.url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"] == {"policy": True, "upstream": False, "encoders": True}
        assert httpx.get(gateway.url + "/healthz").status_code == 200
        assert metric(gateway, "modalgate_upstream_errors_total", code="upstream_unavailable") == 1


def test_upstream_comes_back(tmp_path):
    port = free_port()
    toy = ToyUpstream()
    with GatewayProcess("--upstream", f"http://127.0.0.1:{port}") as gateway:
        assert httpx.get(gateway.url + "/readyz").status_code == 503
        with serve_on(toy, port):
            # The readiness probe is cached for a second: ready within a few, not at once.
            deadline = time.monotonic() + 5
            while httpx.get(gateway.url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the gateway never saw its upstream return"
                time.sleep(0.05)
            assert (
                httpx.post(
                    gateway.url + "/v1/chat/completions", json=chat({"type": "text", "text": "hi"})
                ).status_code
                == 200
            )


def serve_on(toy: ToyUpstream, port: int):
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(toy.app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)

    class _Running:
        def __enter__(self):
            thread.start()
            deadline = time.monotonic() + 10
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.01)
            return server

        def __exit__(self, *exc):
            server.should_exit = True
            thread.join(10)

    return _Running()


def test_shutdown_lets_a_stream_in_flight_finish(upstream):
    toy, base = upstream
    toy.behaviour = Behaviour(tokens=6, token_delay_s=0.3)
    toy.received.clear()
    gateway = GatewayProcess("--upstream", base, "--grace-period", "10").wait_ready()
    try:
        chunks = []
        with httpx.stream(
            "POST",
            gateway.url + "/v1/chat/completions",
            json=chat({"type": "text", "text": "hi"}, stream=True),
            timeout=20,
        ) as response:
            for index, line in enumerate(response.iter_lines()):
                if index == 0:
                    gateway.signal(signal.SIGTERM)
                if line:
                    chunks.append(line)
        assert chunks[-1] == "data: [DONE]"
        assert len(chunks) == 7
        # uvicorn re-raises the SIGTERM it caught once shutdown is done: the conventional end.
        assert gateway.process.wait(15) in (0, -signal.SIGTERM)
        assert "Finished server process" in gateway.text()
    finally:
        gateway.stop()
        gateway.log_path.unlink(missing_ok=True)


def _stalled(url: str, request: bytes) -> tuple[bytes, float]:
    """Send part of a request, go silent, and read until the gateway closes."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    with socket.create_connection((host, port)) as sock:
        sock.settimeout(10)
        sock.sendall(request)
        started = time.monotonic()
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data, time.monotonic() - started


def test_a_client_gone_silent_mid_request_gets_408_and_nothing_reaches_the_upstream(upstream, toy):
    _, base = upstream
    with GatewayProcess("--upstream", base, "--client-timeout", "0.5") as gateway:
        body = orjson.dumps(chat())
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body) + 100}\r\n\r\n"
        ).encode()
        response, waited = _stalled(gateway.url, head + body)
        status, _, rest = response.partition(b"\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout"
        error = orjson.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and error["param"] is None
        assert error["message"] == "the request did not arrive in full: nothing came for 0.5 s"
        assert 0.4 < waited < 5
        # A chunked body (handed to the gate as it arrives), stalled after a chunk: the same.
        chunked = head.replace(
            b"content-length: %d" % (len(body) + 100), b"transfer-encoding: chunked"
        )
        assert b"transfer-encoding: chunked" in chunked
        response, _ = _stalled(gateway.url, chunked + b'5\r\n{"mod\r\n')
        assert response.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert [r.path for r in toy.received if r.method == "POST"] == []
        # The gateway goes on serving.
        answer = client(gateway).chat.completions.create(model="kimi-k3", messages=USER)
        assert answer.choices[0].message.content
        assert [r.path for r in toy.received if r.method == "POST"] == ["/v1/chat/completions"]
        timed_out = [line for line in gateway.log_lines() if line["event"] == "client_timed_out"]
        assert [(line["logger"], line["status"], line["code"]) for line in timed_out] == [
            ("modalgate.protocol", 408, "request_timeout")
        ] * 2
        counted = metric(gateway, "modalgate_requests_total", code="request_timeout")
        assert counted == 2
        # The access log tells the request the app was waiting on as the 408 it was.
        access = [line for line in gateway.log_lines() if line["event"] == "access"]
        assert [(a["method"], a["status"]) for a in access if a["method"] == "POST"] == [
            ("POST", 408),
            ("POST", 408),
            ("POST", 200),
        ]
