"""``POST /v1/encode`` lets go of a request when it ends: a client that goes away takes its
images out of the encoder, and a finished request leaves nothing for the garbage collector
(its verdict holds the image bytes).

Under ``modalgate serve``'s protocol and under plain uvicorn: the first tells the endpoint
that the client is gone by a callback, the second by ``http.disconnect`` on ``receive``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Sequence

import httpx
import pytest
import torch

from conftest import chat, data_url, image_part, noise_png, objects_left_behind, serve
from modalgate.encoder_adapter import Encoded
from modalgate.errors import ErrorCode, Violation
from modalgate.gateway.app import create_app
from modalgate.gateway.http.protocol import ServeHttpProtocol

PROTOCOLS = {"serve": ServeHttpProtocol, "httptools": "httptools"}
REQUEST = chat(
    {"type": "text", "text": "describe"},
    image_part(data_url(noise_png(40, 30, 1))),
    model="kimi-k3",
)


class Encoder:
    """Answers at once (zeros, or the model's failure), or stalls until cancelled."""

    name = "test-encoder"
    modalities = frozenset({"image"})
    max_batch = 8

    def __init__(self) -> None:
        self.behaviour = "answer"
        self.stalled = threading.Event()
        self.cancelled = threading.Event()

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        if self.behaviour == "stall":
            self.stalled.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.behaviour == "fail":
            failure = Violation(ErrorCode.ENCODER_ERROR, "the encoder failed on this image")
            return [Encoded(error=failure) for _ in images]
        return [Encoded(embedding=torch.zeros(4, 8), grid_thw=(1, 4, 4)) for _ in images]

    async def warmup(self) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_client_that_goes_away_takes_its_images_out_of_the_encoder(protocol):
    encoder = Encoder()
    app = create_app(policy=None, mode="encoder", encoder=encoder)
    with serve(app, http=PROTOCOLS[protocol]) as url:
        encoder.behaviour = "stall"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/encode", json=REQUEST, timeout=httpx.Timeout(5, read=0.5))
        assert encoder.stalled.is_set()
        assert encoder.cancelled.wait(5), "the encode went on after its client left"
        encoder.behaviour = "answer"
        answer = httpx.post(url + "/v1/encode", json=REQUEST, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"][0]["shape"] == [4, 8]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("behaviour", "status"), [("answer", 200), ("fail", 500)])
def test_a_finished_encode_leaves_nothing_for_the_garbage_collector(protocol, behaviour, status):
    """An anyio task group watching for the disconnect left ~100 objects of cyclic garbage
    a request, the verdict and its image bytes among them."""
    encoder = Encoder()
    encoder.behaviour = behaviour
    app = create_app(policy=None, mode="encoder", encoder=encoder)

    def encoded() -> None:
        answer = http_client.post("/v1/encode", json=REQUEST)
        assert answer.status_code == status, answer.text

    with serve(app, http=PROTOCOLS[protocol]) as url, httpx.Client(base_url=url) as http_client:
        left = objects_left_behind(encoded)
    assert left == Counter()
