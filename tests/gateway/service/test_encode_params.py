"""``POST /v1/encode`` names an image the same way whether it was encoded or refused.

The adapter is a small one written to the documented protocol: it fails one
particular image the way a model fails on an image every gate check accepted
(``encoder_error``), which no real encoder here can be made to do on demand.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import httpx
import pytest
import torch

from conftest import chat, data_url, image_bytes, image_part, noise_png, serve
from modalgate.encoder_adapter import Encoded
from modalgate.errors import ErrorCode, Violation
from modalgate.gateway.app import create_app

GOOD = noise_png(40, 30, 1)
FAILS = noise_png(36, 36, 2)  # a well-formed PNG the model "fails" on
TINY = image_bytes("PNG", (1, 1))  # refused by the gate (image_too_small)
URL_PARAM = "messages.[0].content.[{}].image_url.url"


class FailsOneImage:
    name = "fails-one"
    modalities = frozenset({"image"})
    max_batch = 8

    async def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        return [
            Encoded(error=Violation(ErrorCode.ENCODER_ERROR, "the encoder failed on this image"))
            if image == FAILS
            else Encoded(embedding=torch.zeros(4, 8), grid_thw=(1, 4, 4))
            for image in images
        ]

    async def warmup(self) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def encoder_url() -> Iterator[str]:
    with serve(create_app(policy=None, mode="encoder", encoder=FailsOneImage())) as url:
        yield url


def encode(url: str, *images: bytes) -> httpx.Response:
    parts = [image_part(data_url(image)) for image in images]
    request = chat({"type": "text", "text": "describe"}, *parts, model="kimi-k3")
    return httpx.post(url + "/v1/encode", json=request, timeout=30)


def test_an_embedding_names_its_image_as_an_error_on_it_would(encoder_url):
    encoded = encode(encoder_url, GOOD, FAILS)  # the second image is content.[2]
    refused = encode(encoder_url, FAILS, GOOD)  # here it is content.[1]
    success = encode(encoder_url, GOOD, GOOD)
    too_small = encode(encoder_url, GOOD, TINY)

    assert encoded.status_code == 500
    error = encoded.json()["error"]
    assert (error["code"], error["param"]) == ("encoder_error", URL_PARAM.format(2))
    assert error["message"].startswith(URL_PARAM.format(2) + ": ")
    assert refused.json()["error"]["param"] == URL_PARAM.format(1)

    assert success.status_code == 200, success.text
    assert [item["param"] for item in success.json()["data"]] == [
        URL_PARAM.format(1),
        URL_PARAM.format(2),
    ]
    # The gate's own checks of the same image name the same param.
    assert too_small.status_code == 400
    error = too_small.json()["error"]
    assert (error["code"], error["param"]) == ("image_too_small", URL_PARAM.format(2))
