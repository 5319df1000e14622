"""A conversation's images, resent every turn, judged once: ``modalgate serve`` in front of
a recording upstream, asked turn after turn by the official ``openai`` SDK, counts its
recalls in ``/metrics``; the policy's off-switch turns them off; a reload with other
limits judges the same bytes afresh; an encoder still gets the bytes of a recalled image.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest

from conftest import chat, data_url, image_part, noise_png, serve
from gateway_proc import GatewayProcess
from modalgate.encoder_adapter import Encoded
from modalgate.errors import ErrorCode
from modalgate.gateway.app import create_app
from modalgate.policy import parse_policy
from toy_upstream import ToyUpstream

PHOTOS = [noise_png(128, 96, seed) for seed in (21, 22)]  # ~49 KB each


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


def lookups(gateway: GatewayProcess) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    series = r'^modalgate_verdict_cache_lookups_total\{result="(\w+)"\} (\S+)$'
    found = re.findall(series, text, re.M)
    return {result: float(value) for result, value in found}


def converse(gateway: GatewayProcess, turns: int) -> list[dict[str, Any]]:
    """A chat that resends its photos every turn, as chat clients do."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    photos = [image_part(data_url(photo)) for photo in PHOTOS]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "compare these"}, *photos]}
    ]
    for turn in range(turns):
        answer = client.chat.completions.create(model="kimi-k3", messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        messages.append({"role": "user", "content": f"and now? ({turn})"})
    return messages


def test_each_turn_after_the_first_recalls_the_photos(upstream, tmp_path):
    toy, base = upstream
    toy.received.clear()
    with GatewayProcess("--upstream", base, "--no-access-log") as gateway:
        assert lookups(gateway) == {"hit": 0.0, "miss": 0.0}
        converse(gateway, turns=3)
        assert lookups(gateway) == {"hit": 4.0, "miss": 2.0}
    # Every turn went on as sent, its photos included.
    turns = [received for received in toy.received if received.method == "POST"]
    assert len(turns) == 3
    for received in turns:
        content = received.json()["messages"][0]["content"]
        assert [part["image_url"]["url"] for part in content[1:]] == [
            data_url(photo) for photo in PHOTOS
        ]


def test_the_policy_turns_it_off(upstream, tmp_path):
    _, base = upstream
    policy = tmp_path / "policy.yaml"
    policy.write_text("extends: builtin\nverdict_cache: {enabled: false}\n", "utf-8")
    with GatewayProcess("--upstream", base, "--policy", str(policy), "--no-access-log") as gateway:
        converse(gateway, turns=2)
        assert lookups(gateway) == {"hit": 0.0, "miss": 0.0}


def test_a_reload_with_other_limits_judges_the_same_bytes_afresh(upstream):
    _, base = upstream
    gateway = create_app(upstream=base)
    request = chat(*(image_part(data_url(photo)) for photo in PHOTOS))
    with serve(gateway) as url:
        assert httpx.post(url + "/v1/chat/completions", json=request).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json=request).status_code == 200
        assert gateway.gate.verdict_cache.hits == 2
        strict = parse_policy(
            "extends: builtin\nmodels:\n  - {name: kimi-k3, match: [kimi-k3], accepts: [image],"
            " limits: {max_image_pixels: 10000}}\n",
            fmt="yaml",
        )
        gateway.gate.set_policy(strict)  # what a reload swaps
        refused = httpx.post(url + "/v1/chat/completions", json=request)
        assert (refused.status_code, refused.json()["error"]["code"]) == (
            400,
            ErrorCode.IMAGE_TOO_LARGE.value,
        )
        gateway.gate.set_policy(parse_policy("extends: builtin\n", fmt="yaml"))
        assert httpx.post(url + "/v1/chat/completions", json=request).status_code == 200
    assert gateway.gate.verdict_cache.hits == 4  # the first limits' entries outlived the swap


class RecordingEncoder:
    """Written to the encoder protocol: records the bytes it is given."""

    name = "recording"
    modalities = frozenset({"image"})
    max_batch = 8

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        import torch  # the main job's; the floors job has no torch and skips this test

        self.seen += images
        return [Encoded(embedding=torch.zeros(4, 8), grid_thw=(1, 4, 4)) for _ in images]

    async def warmup(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_an_encoder_gets_the_bytes_of_a_recalled_image():
    pytest.importorskip("torch")
    encoder = RecordingEncoder()
    gateway = create_app(policy=None, mode="encoder", encoder=encoder)
    request = chat({"type": "text", "text": "describe"}, image_part(data_url(PHOTOS[0])))
    with serve(gateway) as url:
        for _ in range(2):
            assert httpx.post(url + "/v1/encode", json=request, timeout=30).status_code == 200
    assert gateway.gate.verdict_cache.hits == 1
    assert encoder.seen == [PHOTOS[0], PHOTOS[0]]
