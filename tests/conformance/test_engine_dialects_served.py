"""The engine behind a served gateway decides how it reads content parts: detected from
the upstream's /v1/models (``owned_by``), or set with ``--engine`` and vLLM's flags.

Real parts: a uvicorn-served gateway, a toy OpenAI-compatible upstream that says
which engine it is, and the official ``openai`` client."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from conftest import data_url, free_port, image_bytes, serve
from modalgate.gateway.app import create_app
from modalgate.policy import parse_policy
from modalgate.settings import GatewaySettings
from toy_upstream import ToyUpstream

POLICY = parse_policy(
    """
extends: builtin
models:
  - name: toy
    accepts: [image, embeddings]
""",
    fmt="yaml",
)
PNG = data_url(image_bytes("PNG"))
DEFAULT_DETAIL = [{"type": "image_url", "image_url": {"url": PNG, "detail": "default"}}]
ORIGINAL_DETAIL = [{"type": "image_url", "image_url": {"url": PNG, "detail": "original"}}]
IMAGE_EMBEDS = [{"type": "image_embeds", "image_embeds": "AAAA"}]
P0 = "messages.[0].content.[0]"


@contextlib.contextmanager
def upstream(owned_by: str) -> Iterator[ToyUpstream]:
    toy = ToyUpstream(name="toy", owned_by=owned_by)
    with serve(toy.app()) as base:
        toy.base = base  # type: ignore[attr-defined]
        yield toy


@contextlib.contextmanager
def gateway(toy: ToyUpstream, **settings: Any) -> Iterator[openai.OpenAI]:
    base = toy.base  # type: ignore[attr-defined]
    app = create_app(POLICY, settings=GatewaySettings(upstream=base, **settings))
    with (
        serve(app) as url,
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client,
    ):
        yield client


def send(client: openai.OpenAI, content: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model="toy", messages=[{"role": "user", "content": content}]
    )


def refused(client: openai.OpenAI, content: list[dict[str, Any]]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        send(client, content)
    assert caught.value.status_code == 400
    assert caught.value.code == "invalid_request"
    return caught.value


def forwarded(toy: ToyUpstream, client: openai.OpenAI, content: list[dict[str, Any]]) -> None:
    before = len([r for r in toy.received if r.path.endswith("/chat/completions")])
    send(client, content)
    after = [r for r in toy.received if r.path.endswith("/chat/completions")]
    assert len(after) == before + 1
    assert after[-1].json()["messages"][0]["content"] == content


def test_an_sglang_upstream_is_detected_and_read_as_sglang():
    with upstream("sglang") as toy, gateway(toy) as client:
        forwarded(toy, client, DEFAULT_DETAIL)  # SGLang's own detail value
        error = refused(client, ORIGINAL_DETAIL)
        assert error.param == f"{P0}.image_url.detail"
        error = refused(client, IMAGE_EMBEDS)  # SGLang takes no embeddings over HTTP
        assert error.param == f"{P0}.type"
        assert "sglang does not take 'image_embeds' parts" in error.message


def test_a_vllm_upstream_is_detected_and_read_as_vllm():
    with upstream("vllm") as toy, gateway(toy) as client:
        forwarded(toy, client, ORIGINAL_DETAIL)
        assert refused(client, DEFAULT_DETAIL).param == f"{P0}.image_url.detail"
        error = refused(client, IMAGE_EMBEDS)
        assert error.param == f"{P0}.type"
        assert "--enable-mm-embeds" in error.message


def test_vllm_flags_are_settings_of_the_default_upstream():
    with upstream("vllm") as toy, gateway(toy, enable_mm_embeds=True) as client:
        forwarded(toy, client, IMAGE_EMBEDS)


def test_an_upstream_that_names_no_engine_is_read_as_openai():
    with upstream("toy") as toy, gateway(toy) as client:
        forwarded(toy, client, ORIGINAL_DETAIL)
        assert refused(client, DEFAULT_DETAIL).param == f"{P0}.image_url.detail"
        typeless = refused(client, [{"image_url": PNG}])
        assert typeless.param == f"{P0}.type"


def test_the_engine_setting_wins_over_what_the_upstream_says():
    with upstream("vllm") as toy, gateway(toy, engine="sglang") as client:
        forwarded(toy, client, DEFAULT_DETAIL)
        assert refused(client, ORIGINAL_DETAIL).param == f"{P0}.image_url.detail"


def test_an_upstream_down_at_start_is_read_as_its_engine_once_it_answers():
    # Down at start: no model list, so an engine of unknown make (openai). Once a
    # readiness probe gets its list, the gate reads it as vLLM: no wait for a reload.
    port = free_port()
    # vLLM infers a part's type from its key (with a typed part beside it).
    typeless = [{"type": "text", "text": "see"}, {"image_url": {"url": PNG}}]
    app = create_app(POLICY, settings=GatewaySettings(upstream=f"http://127.0.0.1:{port}"))
    toy = ToyUpstream(name="toy", owned_by="vllm")
    with (
        serve(app) as url,
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client,
    ):
        assert httpx.get(url + "/readyz").status_code == 503
        assert refused(client, typeless).param == "messages.[0].content.[1].type"  # openai's
        with serving_on(toy.app(), port):
            deadline = time.monotonic() + 5  # readiness answers are reused for a second
            while httpx.get(url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the gateway never saw its upstream"
                time.sleep(0.05)
            forwarded(toy, client, typeless)


@contextlib.contextmanager
def serving_on(app: Any, port: int) -> Iterator[None]:
    """``app`` under uvicorn on ``port``, chosen before anything listened there."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)
