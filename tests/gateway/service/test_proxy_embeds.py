"""EPD at the door, end to end: the openai client -> ``modalgate serve --encoder kimi:DIR
--upstream`` (a real process) -> the toy upstream, which receives ``image_embeds`` parts.

The forwarded tensors are loaded with ``torch.load(weights_only=True)``, as vLLM loads
them, and compared with the local adapter's own output for the same images.
"""

from __future__ import annotations

import asyncio
import io

import openai
import pybase64
import pytest
import torch

from conftest import MP4_BYTES, data_url, noise_png, serve
from gateway_proc import GatewayProcess
from kimi_tiny import save_full_checkpoint
from modalgate.encoder_adapter.kimi.adapter import KimiEncoderAdapter
from toy_upstream import ToyUpstream

POLICY = """\
extends: builtin
models:
  - name: kimi-epd
    accepts: [image]
    embeds: {}
  - name: kimi-epd-grid
    accepts: [image]
    embeds: {grid_key: image_grid_thw, dtype: bfloat16}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_epd")
    save_full_checkpoint(directory)
    policy = directory / "policy.yaml"
    policy.write_text(POLICY)
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        gateway = GatewayProcess(
            "--upstream", base, "--policy", str(policy), "--encoder", f"kimi:{directory}"
        )
        with gateway.wait_ready(timeout_s=120):
            yield toy, gateway, directory


def local_embeddings(directory, images: list[bytes]):
    async def run():
        adapter = KimiEncoderAdapter(directory)
        try:
            return await adapter.encode(images)
        finally:
            await adapter.close()

    return asyncio.run(run())


def load(b64: str) -> torch.Tensor:
    return torch.load(io.BytesIO(pybase64.b64decode(b64)), weights_only=True)


def ask(gateway: GatewayProcess, model: str, images: list[bytes]):
    content = [{"type": "text", "text": "compare these"}]
    content += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    content.append({"type": "text", "text": "briefly"})
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], timeout=60
    )


def test_images_reach_the_upstream_as_the_encoders_embeddings(setup):
    toy, gateway, directory = setup
    toy.received.clear()
    images = [noise_png(60, 45, 1), noise_png(30, 100, 2)]
    ask(gateway, "kimi-epd", images)
    (received,) = toy.received
    content = received.json()["messages"][0]["content"]
    assert [part["type"] for part in content] == ["text", "image_embeds", "image_embeds", "text"]
    assert content[0] == {"type": "text", "text": "compare these"}
    assert content[3] == {"type": "text", "text": "briefly"}
    expected = local_embeddings(directory, images)
    for part, result in zip(content[1:3], expected, strict=True):
        tensor = load(part["image_embeds"])
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, result.embedding)
    assert int(received.headers["content-length"]) == len(received.body)


def test_the_grid_travels_where_the_family_needs_it(setup):
    toy, gateway, directory = setup
    toy.received.clear()
    images = [noise_png(50, 50, 3)]
    ask(gateway, "kimi-epd-grid", images)
    part = toy.received[0].json()["messages"][0]["content"][1]
    assert part["type"] == "image_embeds"
    tensor = load(part["image_embeds"]["image_embeds"])
    grid = load(part["image_embeds"]["image_grid_thw"])
    (expected,) = local_embeddings(directory, images)
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, expected.embedding.to(torch.bfloat16))
    assert grid.tolist() == list(expected.grid_thw)


def test_what_the_rule_refuses_never_reaches_encoder_or_upstream(setup):
    toy, gateway, _ = setup
    toy.received.clear()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="kimi-epd",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "video_url",
                            "video_url": {"url": data_url(MP4_BYTES, "video/mp4")},
                        }
                    ],
                }
            ],
        )
    assert caught.value.code == "unsupported_modality"
    assert toy.received == []


def test_models_without_embeds_are_forwarded_untouched(setup):
    toy, gateway, _ = setup
    toy.received.clear()
    image = data_url(noise_png(40, 40, 5))
    ask(gateway, "kimi-k3", [noise_png(40, 40, 5)])
    part = toy.received[0].json()["messages"][0]["content"][1]
    assert part == {"type": "image_url", "image_url": {"url": image}}


def test_responses_api_images_for_an_embeds_rule_are_refused_with_the_way_out(setup):
    toy, gateway, _ = setup
    toy.received.clear()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="kimi-epd",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(noise_png(20, 20, 3))}
                    ],
                }
            ],
        )
    assert caught.value.code == "invalid_request"
    assert caught.value.param == "input"
    assert "/v1/chat/completions" in caught.value.message
    assert toy.received == []
    # Text alone has nothing to encode: it passes.
    response = client.responses.create(model="kimi-epd", input="hello")
    assert response.output_text.startswith("toy saw ")
