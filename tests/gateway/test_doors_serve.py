"""The engines' other doors through ``modalgate serve --engine vllm`` in front of the toy
upstream, asked by the official SDKs: the ``anthropic`` SDK on the Messages API (its
refusals in Anthropic's envelope, raised as ``BadRequestError``), the ``openai`` SDK on
reranking and on audio uploads. A refused request never reaches the upstream;
a clean one reaches it byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import orjson
import pytest
from av_media import make_audio

from conftest import b64, image_bytes, serve
from gateway_proc import GatewayProcess
from toy_upstream import ToyUpstream

PNG = image_bytes("PNG", (64, 48))
WAV = make_audio("wav", seconds=1.0)


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


@pytest.fixture(scope="module")
def gateway(upstream) -> Iterator[GatewayProcess]:
    with GatewayProcess("--upstream", upstream[1], "--engine", "vllm") as process:
        yield process


@pytest.fixture
def toy(upstream) -> ToyUpstream:
    toy, _ = upstream
    toy.received.clear()
    return toy


def _image(data: bytes, media_type: str = "image/png") -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": b64(data)},
    }


def claude(gateway: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)


def test_anthropic_sdk_gets_a_truncated_image_refused_in_its_own_envelope(gateway, toy):
    content = [{"type": "text", "text": "what is it?"}, _image(PNG[: len(PNG) // 2])]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(gateway).messages.create(
            model="kimi-k3", max_tokens=8, messages=[{"role": "user", "content": content}]
        )
    body = refused.value.body
    assert refused.value.status_code == 400
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert (body["error"]["code"], body["error"]["param"]) == (
        "invalid_image",
        "messages.[0].content.[1].source.data",
    )
    assert toy.received == []


def test_anthropic_sdk_images_in_a_tool_result_and_count_tokens_are_judged(gateway, toy):
    tool_result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "the chart"}, _image(PNG, "video/mp4")],
    }
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(gateway).messages.count_tokens(
            model="kimi-k3", messages=[{"role": "user", "content": [tool_result]}]
        )
    error = refused.value.body["error"]
    assert (error["code"], error["param"]) == (
        "modality_mismatch",
        "messages.[0].content.[0].content.[1].source.media_type",
    )
    assert toy.received == []


def test_anthropic_sdk_clean_image_reaches_the_upstream_unchanged(gateway, toy):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image(PNG)]}]
    message = claude(gateway).messages.create(model="kimi-k3", max_tokens=8, messages=messages)
    assert message.content[0].text.startswith("toy saw ")
    [received] = [r for r in toy.received if r.path == "/v1/messages"]
    assert received.json()["messages"] == messages


def test_openai_sdk_on_reranking_and_an_image_uploaded_as_audio(gateway, toy):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    video = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}
    rerank = {"model": "kimi-k3", "query": "cats", "documents": ["a", {"content": [video]}]}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/rerank", body=rerank, cast_to=object)
    assert (refused.value.code, refused.value.param) == (
        "unsupported_modality",
        "documents.[1].content.[0].type",
    )
    clean = {"model": "kimi-k3", "query": "cats", "documents": ["a", "b"]}
    assert client.post("/rerank", body=clean, cast_to=object)["path"] == "/v1/rerank"
    assert [orjson.loads(r.body) for r in toy.received] == [clean]
    toy.received.clear()
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="qwen2-audio", file=("a.wav", PNG, "audio/wav"))
    assert (refused.value.code, refused.value.param) == ("modality_mismatch", "file")
    assert toy.received == []


def test_openai_sdk_uploads_a_real_wav_through_the_gate_unchanged(gateway, toy):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    client.audio.transcriptions.with_raw_response.create(
        model="qwen2-audio", file=("a.wav", WAV, "audio/wav")
    )
    [received] = toy.received
    assert received.path == "/v1/audio/transcriptions"
    assert WAV in received.body and b'name="model"' in received.body


def test_openai_sdk_asking_a_text_model_to_speak(gateway, toy):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="kimi-k3",
            messages=[{"role": "user", "content": "say hi"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
    assert (refused.value.code, refused.value.param) == ("unsupported_modality", "modalities.[1]")
    assert toy.received == []
