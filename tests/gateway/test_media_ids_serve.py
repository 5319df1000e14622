"""Media ids through ``modalgate serve --engine vllm`` with two API keys, in front of a
recording upstream, asked by the official ``openai`` SDK: what reaches the engine is never
the client's id, never another key's key, and a key's own reference by id alone reaches it
as its fill did. The same across the other doors that carry ``uuid`` (Responses, batch,
reranking, token-in), and across ``--workers 2`` (one secret, one key per fill).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from conftest import b64, data_url, noise_png, serve
from gateway_proc import GatewayProcess
from modalgate.gateway.gate.media_ids import KEY_PREFIX
from toy_upstream import ToyUpstream

RED, BLUE = noise_png(64, 48, 11), noise_png(64, 48, 12)
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


@pytest.fixture(scope="module")
def gateway(upstream) -> Iterator[GatewayProcess]:
    args = ["--upstream", upstream[1], "--engine", "vllm", "--api-key", ",".join(KEYS)]
    with GatewayProcess(*args) as process:
        yield process


@pytest.fixture
def toy(upstream) -> ToyUpstream:
    toy, _ = upstream
    toy.received.clear()
    return toy


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def part(data: bytes | None, media_id: str) -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": data_url(data)} if data is not None else None,
        "uuid": media_id,
    }


def ask(gateway: GatewayProcess, key: str, *parts: dict[str, Any]) -> None:
    client(gateway, key).chat.completions.create(
        model="kimi-k3",
        messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, *parts]}],
        max_tokens=4,
    )


def engine_ids(toy: ToyUpstream) -> list[Any]:
    (received,) = toy.received
    toy.received.clear()
    content = received.json()["messages"][0]["content"]
    return [p.get("uuid") for p in content[1:]]


def test_two_keys_never_share_a_key_and_references_stay_with_their_key(gateway, toy):
    ask(gateway, "key-a", part(RED, "photo"))
    (a_red,) = engine_ids(toy)
    assert a_red.startswith(KEY_PREFIX)

    # The second key names the first key's id with a null payload: refused, nothing sent.
    with pytest.raises(openai.BadRequestError) as refused:
        ask(gateway, "key-b", part(None, "photo"))
    assert (refused.value.code, refused.value.param) == (
        "unknown_media_id",
        "messages.[0].content.[1].uuid",
    )
    assert toy.received == []

    # The same id and bytes from the second key: a key of its own.
    ask(gateway, "key-b", part(RED, "photo"))
    assert engine_ids(toy) != [a_red]

    # The first key's own reference reaches the engine as its fill did.
    ask(gateway, "key-a", part(None, "photo"))
    assert engine_ids(toy) == [a_red]

    # One key reusing its id for other bytes: a new key, and references follow it.
    ask(gateway, "key-a", part(BLUE, "photo"))
    (a_blue,) = engine_ids(toy)
    assert a_blue not in (a_red, "photo")
    ask(gateway, "key-a", part(None, "photo"))
    assert engine_ids(toy) == [a_blue]


def test_an_id_the_gateway_never_saw_is_refused(gateway, toy):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(gateway, "key-a", part(None, "never-sent"))
    assert refused.value.status_code == 400
    assert refused.value.code == "unknown_media_id"
    assert toy.received == []


def _post(gateway: GatewayProcess, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)


# Each door vLLM reads a ``uuid`` on (docs/media_id_census.md), with where the id sits.
DOORS = [
    (
        "/v1/responses",
        {
            "model": "kimi-k3",
            # vLLM passes a message item's parts to its chat parser: an ``input_image``
            # with a uuid would be read by its key there, so the gate asks for agreement.
            "input": [{"role": "user", "content": [part(RED, "photo")]}],
        },
        ("input", 0, "content", 0, "uuid"),
    ),
    (
        "/v1/chat/completions/batch",
        {"model": "kimi-k3", "messages": [[{"role": "user", "content": [part(RED, "photo")]}]]},
        ("messages", 0, 0, "content", 0, "uuid"),
    ),
    (
        "/v1/rerank",
        {
            "model": "kimi-k3",
            "query": "a red thing",
            "documents": {"content": [part(RED, "photo")]},
        },
        ("documents", "content", 0, "uuid"),
    ),
    (
        "/inference/v1/generate",
        {
            "model": "kimi-k3",
            "token_ids": [1, 2],
            "content_parts": [{"type": "image_url", "url": data_url(RED), "uuid": "photo"}],
        },
        ("content_parts", 0, "uuid"),
    ),
]


@pytest.mark.parametrize(("door", "body", "where"), DOORS, ids=[d[0] for d in DOORS])
def test_every_door_that_carries_ids_binds_them(gateway, toy, door, body, where):
    keys = []
    for key in KEYS:
        response = _post(gateway, door, body, key)
        assert response.status_code == 200, response.text
        (received,) = toy.received
        toy.received.clear()
        value: Any = received.json()
        for step in where:
            value = value[step]
        keys.append(value)
    assert all(k.startswith(KEY_PREFIX) for k in keys) and keys[0] != keys[1]


def test_token_in_features_hashes_are_bound(gateway, toy):
    features = {
        "mm_hashes": {"image": ["their-hash"]},
        "kwargs_data": {"image": [{"pixel_values": b64(b"\x01" * 32)}]},
    }
    body = {"model": "kimi-k3", "token_ids": [1], "features": features}
    # The built-in kimi-k3 rule takes no client embeddings: its tensors are refused.
    refused = _post(gateway, "/inference/v1/generate", body, "key-a")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_modality"
    assert toy.received == []
    reference = {"model": "kimi-k3", "token_ids": [1], "features": {"mm_hashes": {"image": ["h"]}}}
    unknown = _post(gateway, "/inference/v1/generate", reference, "key-a")
    assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (
        "unknown_media_id",
        "features.mm_hashes.image.[0]",
    )


def test_workers_share_one_secret_so_a_fill_gets_one_key(upstream, tmp_path):
    """Under ``--workers 2`` each worker remembers its own fills: a reference answered by
    the other worker is refused (``unknown_media_id``), never sent on with another key."""
    toy, base = upstream
    args = ["--workers", "2", "--upstream", base, "--engine", "vllm", "--api-key", "key-a"]
    gateway = GatewayProcess(*args, env={"TMPDIR": str(tmp_path)})
    try:
        gateway.wait_ready(120)
    except RuntimeError:
        gateway.stop()
        raise
    fill = {"model": "kimi-k3", "messages": [{"role": "user", "content": [part(RED, "p")]}]}
    reference = {"model": "kimi-k3", "messages": [{"role": "user", "content": [part(None, "p")]}]}
    with gateway:
        toy.received.clear()
        filled = set()
        for _ in range(12):  # a new connection each: the kernel hands it to either worker
            assert _post(gateway, "/v1/chat/completions", fill, "key-a").status_code == 200
            filled.add(orjson.loads(toy.received.pop().body)["messages"][0]["content"][0]["uuid"])
        assert len(filled) == 1
        outcomes = set()
        for _ in range(12):
            response = _post(gateway, "/v1/chat/completions", reference, "key-a")
            if response.status_code == 200:
                sent = orjson.loads(toy.received.pop().body)["messages"][0]["content"][0]
                assert sent["uuid"] in filled
                outcomes.add("resolved")
            else:
                assert response.json()["error"]["code"] == "unknown_media_id"
                outcomes.add("unknown")
        assert "resolved" in outcomes
