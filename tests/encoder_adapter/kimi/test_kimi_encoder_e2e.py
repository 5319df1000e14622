"""The local Kimi encoder adapter and ``POST /v1/encode``, on a tiny real Kimi-K2.5 checkpoint.

Reference: the same in-memory transformers model's ``get_image_features`` on inputs
from transformers' ``Kimi_K25ImageProcessor``; the adapter goes through its own path
(decode pool, KimiPreprocessor, vision-only load, micro-batcher).
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pybase64
import pytest
import torch
from PIL import Image

from conftest import MP4_BYTES, chat, data_url, image_part, noise_png, serve
from gateway_proc import GatewayProcess
from kimi_tiny import processor, save_full_checkpoint
from modalgate.encoder_adapter import BatchSettings, Overloaded, create_encoder
from modalgate.encoder_adapter.kimi.adapter import KimiEncoderAdapter
from modalgate.gateway.app import create_app
from modalgate.policy import parse_policy

SIZES = [(60, 45), (30, 100), (28, 28), (200, 90)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_e2e")
    return directory, save_full_checkpoint(directory)


def reference(model, images: list[bytes]) -> list[torch.Tensor]:
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    batch = processor()(pil, return_tensors="pt")
    with torch.inference_mode():
        features = model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    return [f.float() for f in features.pooler_output]


def encode(adapter: KimiEncoderAdapter, images: list[bytes]):
    async def run():
        try:
            return await adapter.encode(images)
        finally:
            await adapter.close()

    return asyncio.run(run())


def test_embeddings_equal_the_models_own_forward(checkpoint):
    directory, model = checkpoint
    images = [noise_png(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    adapter = create_encoder(f"kimi:{directory}")  # what --encoder gives: device auto
    on_gpu = torch.cuda.is_available()  # bf16 there
    tolerance = {"rtol": 5e-2, "atol": 5e-2} if on_gpu else {"rtol": 1e-5, "atol": 1e-5}
    results = encode(adapter, images)
    for result, expected in zip(results, reference(model, images), strict=True):
        assert result.error is None
        assert result.embedding.shape == expected.shape
        torch.testing.assert_close(result.embedding, expected, **tolerance)
        t, h, w = result.grid_thw
        assert t * h * w // 4 == expected.shape[0]


def test_a_bad_image_fails_alone_and_the_cache_serves_repeats(checkpoint):
    directory, model = checkpoint
    good = noise_png(64, 40, 7)
    adapter = KimiEncoderAdapter(directory, device="cpu")

    async def run():
        try:
            first = await adapter.encode([good, b"\x89PNG\r\n\x1a\n broken", good])
            again = await adapter.encode([good])
            return first, again, adapter.batcher.items
        finally:
            await adapter.close()

    (first_good, broken, second_good), [again], model_items = asyncio.run(run())
    assert broken.error is not None and broken.error.code.value == "invalid_image"
    assert first_good.error is None and second_good.error is None
    assert again.cached and torch.equal(again.embedding, first_good.embedding)
    assert model_items == 1  # the repeat within the request and the later one skip the model
    torch.testing.assert_close(
        first_good.embedding, reference(model, [good])[0], rtol=1e-5, atol=1e-5
    )


def test_concurrent_requests_are_batched_and_land_on_the_right_request(checkpoint):
    directory, model = checkpoint
    images = [noise_png(40 + 4 * i, 30 + 2 * i, 100 + i) for i in range(16)]
    adapter = KimiEncoderAdapter(
        directory, device="cpu", batch=BatchSettings(max_items=8, max_wait_ms=50)
    )

    async def run():
        try:
            results = await asyncio.gather(*(adapter.encode([image]) for image in images))
            return [r[0] for r in results], adapter.batcher.batches
        finally:
            await adapter.close()

    results, batches = asyncio.run(run())
    assert batches < 16
    for result, expected in zip(results, reference(model, images), strict=True):
        torch.testing.assert_close(result.embedding, expected, rtol=1e-5, atol=1e-5)


def test_a_full_queue_is_refused(checkpoint):
    adapter = KimiEncoderAdapter(checkpoint[0], batch=BatchSettings(max_queue=1))
    with pytest.raises(Overloaded):
        encode(adapter, [noise_png(30, 30, 1), noise_png(31, 30, 2)])


@pytest.fixture(scope="module")
def encoder_url(checkpoint):
    adapter = KimiEncoderAdapter(checkpoint[0], device="cpu")
    with serve(create_app(policy=None, mode="encoder", encoder=adapter)) as url:
        yield url, adapter


def decode_embedding(item: dict) -> np.ndarray:
    raw = pybase64.b64decode(item["embedding"])
    return np.frombuffer(raw, dtype="<f4").reshape(item["shape"])


def test_encode_endpoint_returns_embeddings(encoder_url, checkpoint):
    url, _ = encoder_url
    images = [noise_png(60, 45, 1), noise_png(30, 100, 2)]
    request = chat(
        {"type": "text", "text": "describe"},
        *(image_part(data_url(image)) for image in images),
        model="kimi-k3",
    )
    response = httpx.post(url + "/v1/encode", json=request, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert (answer["object"], answer["model"]) == ("list", "kimi-k3")
    expected = reference(checkpoint[1], images)
    for index, (item, want) in enumerate(zip(answer["data"], expected, strict=True)):
        assert item["object"] == "image_embedding"
        assert item["index"] == index
        assert item["param"] == f"messages.[0].content.[{index + 1}].image_url.url"
        assert item["dtype"] == "float32"
        assert item["tokens"] == item["shape"][0] == want.shape[0]
        assert item["grid_thw"][0] == 1
        np.testing.assert_allclose(decode_embedding(item), want.numpy(), rtol=1e-5, atol=1e-5)


def test_video_never_reaches_the_encoder(encoder_url):
    url, adapter = encoder_url
    before = adapter.batcher.items
    request = chat(
        {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}},
        model="kimi-k3",
    )
    response = httpx.post(url + "/v1/encode", json=request, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (
        "unsupported_modality",
        "messages.[0].content.[0].type",
    )
    assert "Kimi-K3 encoder mode supports image input only" in error["message"]
    assert adapter.batcher.items == before


def test_overload_is_a_503_with_retry_after(checkpoint):
    adapter = KimiEncoderAdapter(checkpoint[0], batch=BatchSettings(max_queue=0))
    with serve(create_app(policy=None, mode="encoder", encoder=adapter)) as url:
        request = chat(image_part(data_url(noise_png(30, 30, 3))), model="kimi-k3")
        response = httpx.post(url + "/v1/encode", json=request, timeout=30)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "encoder_overloaded"
    assert response.json()["error"]["type"] == "server_error"


def test_modalgate_serve_with_an_encoder(checkpoint):
    """The command users run: modalgate serve --mode encoder --encoder kimi:DIR."""
    script = Path(sys.executable).with_name("modalgate")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "modalgate.gateway.cli"]
    serve_args = ["serve", "--mode", "encoder", "--encoder", f"kimi:{checkpoint[0]}"]
    serve_args += ["--port", "{port}", "--log-level", "warning"]
    gateway = GatewayProcess(command=[*command, *serve_args])
    try:
        gateway.wait_ready(timeout_s=90)
        request = chat(image_part(data_url(noise_png(50, 50, 4))), model="kimi-k3")
        response = httpx.post(gateway.url + "/v1/encode", json=request, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["shape"][0] == 4  # 50x50 -> pad 56x56 -> 2x2 tokens
    finally:
        gateway.stop()
        gateway.log_path.unlink(missing_ok=True)


def test_a_policy_rule_picks_its_encoder(checkpoint, tmp_path):
    policy = parse_policy(
        f"""
extends: builtin
models:
  - name: house-vit
    match: ["acme/house-vit*"]
    mode: encoder
    accepts: [image]
    encoder: "kimi:{checkpoint[0]}"
""",
        fmt="yaml",
    )
    with serve(create_app(policy=policy, mode="encoder")) as url:
        ok = httpx.post(
            url + "/v1/encode",
            json=chat(image_part(data_url(noise_png(50, 50, 5))), model="acme/house-vit-1"),
            timeout=60,
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["data"][0]["tokens"] == 4
        # kimi-k3 has no encoder here and there is no default: a clear 400, not a 500.
        missing = httpx.post(
            url + "/v1/encode",
            json=chat(image_part(data_url(noise_png(50, 50, 5))), model="kimi-k3"),
            timeout=60,
        )
    assert missing.status_code == 400
    error = missing.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "model")


def test_serve_refuses_an_encoder_that_cannot_load(tmp_path):
    script = Path(sys.executable).with_name("modalgate")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "modalgate.gateway.cli"]
    result = subprocess.run(
        [*command, "serve", "--encoder", f"kimi:{tmp_path / 'missing'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "cannot start the encoder" in result.stderr
    assert "Traceback" not in result.stderr
