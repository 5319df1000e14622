"""Metrics, structured logs and request ids: real Prometheus registries, real servers."""

from __future__ import annotations

import asyncio
import contextvars
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from conftest import MP4_BYTES, b64, body, chat, data_url, image_bytes, image_part, serve
from modalgate import ModalGate
from modalgate.encoder_adapter import BatchSettings, EmbeddingCache, MicroBatcher
from modalgate.errors import ErrorCode, Violation
from modalgate.gateway.gate.outcome import GateOutcome
from modalgate.gateway.observability.logs import (
    JsonFormatter,
    configure_logging,
    log_outcome,
    request_id_var,
    uvicorn_log_config,
)
from modalgate.gateway.observability.metrics import GatewayMetrics, metrics_endpoint
from modalgate.gateway.observability.request_id import RequestId

# ---------------------------------------------------------------- helpers


def samples(metrics: GatewayMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of the rendered text, keyed by (name, labels)."""
    text = metrics.render()[0].decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, frozenset(labels.items())))


def outcome(
    accepted: bool = True,
    code: ErrorCode | None = None,
    rule: str | None = "kimi-k3-encoder",
    mode: str | None = "encoder",
    model: str | None = "kimi-k3",
    body_bytes: int = 2000,
    seconds: float = 0.002,
) -> GateOutcome:
    violations = () if code is None else (Violation(code, "refused", "messages.[0]"),)
    return GateOutcome(accepted, violations, model, mode, rule, body_bytes, seconds, "/v1/x")


def with_lifespan(app):
    """A bare ASGI app made servable under ``serve`` (which runs lifespan)."""

    async def wrapped(scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        await receive()
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})

    return wrapped


LOGGERS = ("modalgate", "uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Logging is process-wide: put back what a test reconfigures."""
    saved = {}
    for name in LOGGERS:
        lg = logging.getLogger(name)
        saved[name] = (list(lg.handlers), lg.level, lg.propagate)
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.fixture
def json_lines(restore_logging) -> Callable[[], list[dict[str, Any]]]:
    """The modalgate tree's records so far, formatted by the real JsonFormatter, parsed back."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("modalgate")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return lambda: [orjson.loads(line) for line in stream.getvalue().splitlines()]


# ---------------------------------------------------------------- metrics


def test_outcomes_are_counted_by_rule_mode_outcome_and_code():
    metrics = GatewayMetrics()
    metrics.observe_outcome(outcome())
    metrics.observe_outcome(outcome(False, ErrorCode.UNSUPPORTED_MODALITY))
    metrics.observe_outcome(outcome(False, ErrorCode.UNSUPPORTED_MODALITY, body_bytes=5_000_000))
    metrics.observe_outcome(outcome(False, ErrorCode.UNKNOWN_MODEL, rule=None, mode=None))
    got = {k: v for k, v in samples(metrics).items() if k[0] == "modalgate_requests_total"}
    label = lambda model, mode, result, code: (  # noqa: E731
        "modalgate_requests_total",
        frozenset({"model": model, "mode": mode, "outcome": result, "code": code}.items()),
    )
    assert got == {
        label("kimi-k3-encoder", "encoder", "accepted", ""): 1.0,
        label("kimi-k3-encoder", "encoder", "rejected", "unsupported_modality"): 2.0,
        label("unknown", "", "rejected", "unknown_model"): 1.0,
    }
    assert value(metrics, "modalgate_validation_seconds_count") == 4
    assert value(metrics, "modalgate_validation_seconds_sum") == pytest.approx(0.008)
    assert value(metrics, "modalgate_request_body_bytes_bucket", le="1024.0") == 0
    assert value(metrics, "modalgate_request_body_bytes_bucket", le="4096.0") == 3
    assert value(metrics, "modalgate_request_body_bytes_bucket", le="4.194304e+06") == 3
    assert value(metrics, "modalgate_request_body_bytes_bucket", le="1.6777216e+07") == 4


def test_two_instances_do_not_share_a_registry():
    first, second = GatewayMetrics(), GatewayMetrics()  # same names: no collision
    first.observe_outcome(outcome())
    first.routed("kimi-k3", "kimi-k2.5")
    assert (
        value(
            first,
            "modalgate_requests_total",
            model="kimi-k3-encoder",
            mode="encoder",
            outcome="accepted",
            code="",
        )
        == 1
    )
    assert not [k for k in samples(second) if k[0] == "modalgate_requests_total"]
    assert value(second, "modalgate_validation_seconds_count") == 0
    assert (
        value(first, "modalgate_fallback_routes_total", from_model="kimi-k3", to_model="kimi-k2.5")
        == 1
    )


def test_upstream_stream_and_policy_reload_figures():
    metrics = GatewayMetrics()
    assert value(metrics, "modalgate_policy_reloads_total", outcome="error") == 0  # from the start
    metrics.observe_upstream(0.2, 200, None)
    metrics.observe_upstream(0.3, 503, "upstream_unavailable", route="b")
    metrics.observe_upstream(30.0, None, "upstream_timeout")
    metrics.observe_stream_end(12.0)
    before = time.time()
    metrics.policy_reload(True)
    metrics.policy_reload(False)
    assert (
        value(metrics, "modalgate_upstream_seconds_count", route="default", status_class="2xx") == 1
    )
    assert value(metrics, "modalgate_upstream_seconds_count", route="b", status_class="5xx") == 1
    assert (
        value(metrics, "modalgate_upstream_seconds_count", route="default", status_class="error")
        == 1
    )
    assert (
        value(metrics, "modalgate_upstream_errors_total", route="b", code="upstream_unavailable")
        == 1
    )
    assert (
        value(metrics, "modalgate_upstream_errors_total", route="default", code="upstream_timeout")
        == 1
    )
    assert value(metrics, "modalgate_upstream_response_seconds_sum", route="default") == 12.0
    assert value(metrics, "modalgate_policy_reloads_total", outcome="ok") == 1
    assert value(metrics, "modalgate_policy_reloads_total", outcome="error") == 1
    assert value(metrics, "modalgate_policy_last_reload_timestamp_seconds") >= before


class TinyAdapter:
    """The attributes KimiEncoderAdapter exposes, on real parts."""

    def __init__(self, batcher: MicroBatcher, cache: EmbeddingCache) -> None:
        self.batcher = batcher
        self.cache = cache


def test_encoder_figures_come_from_a_real_batcher_and_cache():
    metrics = GatewayMetrics()
    cache = EmbeddingCache()
    cache.put("a", "embedding", 10)
    cache.get("a"), cache.get("a"), cache.get("b")

    async def main() -> MicroBatcher:
        batcher = MicroBatcher(lambda items: [i * 2 for i in items], BatchSettings(max_items=2))
        metrics.watch_encoder(TinyAdapter(batcher, cache), "kimi")
        metrics.watch_encoder(object(), "bare")  # nothing to read: skipped, no error
        assert await asyncio.gather(*(batcher.submit(i) for i in range(5))) == [0, 2, 4, 6, 8]
        await batcher.close()
        return batcher

    batcher = asyncio.run(main())
    assert batcher.batches >= 3  # max_items=2 for 5 items
    enc = {"encoder": "kimi"}
    assert value(metrics, "modalgate_encoder_batches_total", **enc) == batcher.batches
    assert value(metrics, "modalgate_encoder_images_total", **enc) == 5
    assert value(metrics, "modalgate_encoder_queue_depth", **enc) == 0
    assert value(metrics, "modalgate_encoder_cache_hits_total", **enc) == 2
    assert value(metrics, "modalgate_encoder_cache_misses_total", **enc) == 1
    assert value(metrics, "modalgate_encoder_cache_bytes", **enc) == 10
    # The on_batch hook: one observation per forward pass, sizes summing to the items.
    assert value(metrics, "modalgate_encoder_batch_size_count", **enc) == batcher.batches
    assert value(metrics, "modalgate_encoder_batch_size_sum", **enc) == 5
    assert value(metrics, "modalgate_encoder_batch_size_bucket", le="2.0", **enc) == batcher.batches
    assert value(metrics, "modalgate_encoder_batch_seconds_count", **enc) == batcher.batches
    assert not [k for k in samples(metrics) if ("encoder", "bare") in k[1]]


def test_queue_depth_is_read_at_scrape_time():
    metrics = GatewayMetrics()
    gate = threading.Event()
    started = threading.Event()

    def blocked(items: list[int]) -> list[int]:
        started.set()
        gate.wait(10)
        return items

    async def main() -> float | None:
        batcher = MicroBatcher(blocked, BatchSettings(max_items=1, max_wait_ms=0))
        metrics.watch_encoder(TinyAdapter(batcher, EmbeddingCache()), "kimi")
        tasks = [asyncio.create_task(batcher.submit(i)) for i in range(3)]
        assert await asyncio.to_thread(started.wait, 10), "no batch reached the model"
        deadline = time.monotonic() + 10
        while batcher.queue_depth != 2:  # the first is in the model thread
            assert time.monotonic() < deadline, batcher.queue_depth
            await asyncio.sleep(0.001)
        depth = value(metrics, "modalgate_encoder_queue_depth", encoder="kimi")
        gate.set()
        await asyncio.gather(*tasks)
        await batcher.close()
        return depth

    assert asyncio.run(main()) == 2


def test_a_failing_on_batch_observer_does_not_stop_the_batcher():
    def broken(size: int, seconds: float) -> None:
        raise RuntimeError("observer bug")

    async def main() -> list[int]:
        batcher = MicroBatcher(lambda items: items, BatchSettings(max_items=1))
        batcher.on_batch = broken
        results = await asyncio.gather(*(batcher.submit(i) for i in range(3)))
        await batcher.close()
        return results

    assert asyncio.run(main()) == [0, 1, 2]


def test_metrics_endpoint_speaks_text_and_openmetrics():
    metrics = GatewayMetrics()
    metrics.observe_outcome(outcome())
    app = Starlette(routes=[Route("/metrics", metrics_endpoint(metrics), methods=["GET"])])

    async def main() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            plain = await client.get("/metrics")
            om = await client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        return plain, om

    plain, om = asyncio.run(main())
    assert plain.status_code == 200
    assert plain.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(plain.text)}
    assert "modalgate_requests" in names
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")


# ---------------------------------------------------------------- logs


def test_json_lines_carry_the_request_id_and_bounded_fields(json_lines):
    log = logging.getLogger("modalgate.test")
    secret = b64(image_bytes())

    def in_request() -> None:
        request_id_var.set("req-7")
        log.info("hello %s", "there", extra={"fields": {"n": 3, "blob": secret, "ts": "x"}})
        try:
            raise ValueError("bad thing")
        except ValueError:
            log.exception("failed")

    contextvars.copy_context().run(in_request)
    log.info("outside")
    hello, failed, outside = json_lines()
    assert hello["event"] == "hello there" and hello["n"] == 3 and hello["request_id"] == "req-7"
    assert hello["ts"].endswith("+00:00") and hello["ts"] != "x"  # core keys are not overridable
    assert secret[:64] not in orjson.dumps([hello, failed, outside]).decode()
    assert "elided" in hello["blob"]
    assert failed["level"] == "error" and failed["exc_type"] == "ValueError"
    assert failed["exc"] == "bad thing" and "in_request" in failed["exc_at"]
    assert "traceback" not in failed  # only with tracebacks=True (DEBUG)
    assert "request_id" not in outside


def test_log_outcome_writes_one_line_per_refusal(json_lines):
    log_outcome(outcome())  # accepted: nothing at INFO
    rejected = outcome(False, ErrorCode.UNSUPPORTED_MODALITY, model="m" * 5000)
    contextvars.copy_context().run(lambda: (request_id_var.set("r1"), log_outcome(rejected)))
    (line,) = json_lines()
    assert line["event"] == "request_rejected" and line["request_id"] == "r1"
    assert (line["status"], line["code"], line["param"]) == (
        400,
        "unsupported_modality",
        "messages.[0]",
    )
    assert (line["rule"], line["mode"], line["body_bytes"], line["violations"]) == (
        "kimi-k3-encoder",
        "encoder",
        2000,
        1,
    )
    assert len(line["model"]) <= 101


def test_a_refused_request_is_counted_and_logged_without_its_image(json_lines):
    metrics = GatewayMetrics()

    def observe(result: GateOutcome) -> None:
        metrics.observe_outcome(result)
        log_outcome(result)

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({})

    inner = Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"])])
    app = RequestId(ModalGate(inner, on_outcome=observe))
    picture = b64(image_bytes(size=(256, 256)))
    video = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
    request = chat(image_part(f"data:image/png;base64,{picture}"), video, model="qwen2-audio")

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post(
                "/v1/chat/completions",
                content=body(request),
                headers={"content-type": "application/json", "x-request-id": "client-42"},
            )

    response = asyncio.run(main())
    assert response.status_code == 400
    assert response.headers.get_list("x-request-id") == ["client-42"]
    code = response.json()["error"]["code"]
    lines = json_lines()
    rejected = [line for line in lines if line["event"] == "request_rejected"]
    assert len(rejected) == 1 and rejected[0]["request_id"] == "client-42"
    assert rejected[0]["code"] == code and rejected[0]["rule"] == "qwen2-audio"
    access = [line for line in lines if line["logger"] == "modalgate.access"]
    assert [(a["status"], a["path"], a["request_id"]) for a in access] == [
        (400, "/v1/chat/completions", "client-42")
    ]
    text = orjson.dumps(lines).decode()
    assert picture[:40] not in text and picture[-40:] not in text
    assert (
        value(
            metrics,
            "modalgate_requests_total",
            model="qwen2-audio",
            mode="",
            outcome="rejected",
            code=code,
        )
        == 1
    )
    assert request_id_var.get() is None


def test_configure_logging_replaces_its_own_handler(restore_logging):
    configure_logging("debug", "text")
    configure_logging("warning", "json")
    root = logging.getLogger("modalgate")
    assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.WARNING and root.propagate is False
    with pytest.raises(ValueError):
        configure_logging("loud")


def test_uvicorn_errors_come_out_as_json_with_the_request_id(restore_logging, capfd):
    @with_lifespan
    async def boom(scope, receive, send) -> None:
        raise RuntimeError("inner failure")

    with serve(RequestId(boom), log_config=uvicorn_log_config("info", "json")) as url:
        response = httpx.get(f"{url}/x?secret=1", headers={"x-request-id": "boom-1"})
    assert response.status_code == 500
    lines = [orjson.loads(s) for s in capfd.readouterr().err.splitlines() if s.startswith("{")]
    error = [s for s in lines if s["logger"] == "uvicorn.error" and s["level"] == "error"]
    assert error and error[0]["request_id"] == "boom-1" and error[0]["exc_type"] == "RuntimeError"
    access = [s for s in lines if s["logger"] == "modalgate.access"]
    assert [(a["status"], a["path"], a["exc_type"]) for a in access] == [
        (500, "/x", "RuntimeError")
    ]


# ---------------------------------------------------------------- request ids


def echo_app(seen: list[dict[str, Any]], own_id: bytes | None = None):
    """Records what it was handed; optionally sets an x-request-id of its own."""

    async def app(scope, receive, send) -> None:
        seen.append(
            {
                "ids": [v for k, v in scope["headers"] if k == b"x-request-id"],
                "state": scope["state"].get("request_id"),
                "var": request_id_var.get(),
            }
        )
        headers = [(b"content-type", b"text/plain")]
        if own_id is not None:
            headers.append((b"X-Request-ID", own_id))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def get(app, headers: dict[str, Any] | None = None) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/p?q=1", headers=headers)

    return asyncio.run(main())


def test_an_incoming_id_is_honoured_everywhere():
    seen: list[dict[str, Any]] = []
    response = get(
        RequestId(echo_app(seen, own_id=b"inner")), {"X-Request-ID": "abc.DEF-1:2@x/y+z="}
    )
    assert response.headers.get_list("x-request-id") == [
        "abc.DEF-1:2@x/y+z="
    ]  # the app's is replaced
    assert seen == [
        {"ids": [b"abc.DEF-1:2@x/y+z="], "state": "abc.DEF-1:2@x/y+z=", "var": "abc.DEF-1:2@x/y+z="}
    ]


@pytest.mark.parametrize("bad", ["", "x" * 129, "has space", "semi;colon", 'quote"d', b"caf\xe9"])
def test_a_bad_id_is_replaced_by_a_new_one(bad):
    seen: list[dict[str, Any]] = []
    response = get(RequestId(echo_app(seen)), {"x-request-id": bad})
    (new,) = response.headers.get_list("x-request-id")
    assert len(new) == 32 and int(new, 16) >= 0
    assert seen == [{"ids": [new.encode()], "state": new, "var": new}]  # forwarded: the same id


def test_a_missing_id_is_made_and_forwarded_and_the_context_is_clean_after():
    seen: list[dict[str, Any]] = []
    app = RequestId(echo_app(seen))
    first, second = get(app), get(app)
    ids = [r.headers["x-request-id"] for r in (first, second)]
    assert ids[0] != ids[1] and [s["ids"] for s in seen] == [[i.encode()] for i in ids]
    assert request_id_var.get() is None


def test_access_line_and_its_switch(json_lines):
    get(RequestId(echo_app([])), {"x-request-id": "acc-1"})
    get(RequestId(echo_app([]), access_log=False), {"x-request-id": "acc-2"})
    (line,) = json_lines()
    assert line["logger"] == "modalgate.access" and line["level"] == "info"
    assert (line["method"], line["path"], line["status"], line["request_id"]) == (
        "GET",
        "/p",
        200,
        "acc-1",
    )
    assert line["duration_ms"] >= 0


def test_websocket_gets_an_id_and_lifespan_passes_untouched():
    sent: list[dict[str, Any]] = []
    scopes: list[dict[str, Any]] = []

    async def inner(scope, receive, send) -> None:
        scopes.append(scope)
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept", "headers": [(b"x-request-id", b"old")]})

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        app = RequestId(inner, access_log=False)
        lifespan = {"type": "lifespan", "asgi": {"version": "3.0"}}
        await app(lifespan, receive, send)
        ws = {"type": "websocket", "path": "/ws", "headers": [(b"x-request-id", b"ws-1")]}
        await app(ws, receive, send)

    asyncio.run(main())
    assert scopes[0]["type"] == "lifespan" and "state" not in scopes[0]
    assert scopes[1]["state"]["request_id"] == "ws-1"
    assert sent == [{"type": "websocket.accept", "headers": [(b"x-request-id", b"ws-1")]}]


def test_a_streamed_response_is_not_buffered():
    first_seen = threading.Event()
    sent_last_after_first_seen: list[bool] = []

    @with_lifespan
    async def streaming(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one;", "more_body": True})
        await asyncio.to_thread(first_seen.wait, 2)  # under httpx's 5 s read timeout
        await send({"type": "http.response.body", "body": b"two;", "more_body": True})
        sent_last_after_first_seen.append(first_seen.is_set())
        await send({"type": "http.response.body", "body": b"three", "more_body": False})

    with serve(RequestId(streaming, access_log=False)) as url, httpx.stream("GET", url) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        first_seen.set()
        rest = b"".join(chunks)
        assert (
            response.headers.get_list("x-request-id")
            and len(response.headers["x-request-id"]) == 32
        )
    assert first == b"one;" and first + rest == b"one;two;three"
    assert sent_last_after_first_seen == [True]


def test_made_ids_are_32_hex_digits_unique_and_reseeded_in_a_forked_child():
    import os

    from modalgate.gateway.observability.request_id import new_id

    made = {new_id() for _ in range(10_000)}
    assert len(made) == 10_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next id, written back
        os.write(writer, new_id().encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(pid, 0)
    child = os.read(reader, 64).decode()
    os.close(reader)
    assert len(child) == 32 and child != new_id()
