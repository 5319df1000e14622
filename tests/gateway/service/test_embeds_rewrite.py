"""The encoder-side rewrite: accepted images become vLLM ``image_embeds`` parts, in place.

Real parts throughout: Pillow images in data URLs, a request validated by the real
validators under a policy with ``embeds``, a tiny real Kimi-K2.5 checkpoint behind the real
``KimiEncoderAdapter``. The reference for every tensor is the adapter's own ``encode()``
of the same images in one call (CPU: bit-identical run to run).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import subprocess
import sys

import numpy as np
import orjson
import pybase64
import pytest
import torch
from PIL import Image

from conftest import WAV_BYTES, b64, data_url, png_bomb
from kimi_tiny import save_full_checkpoint
from modalgate.encoder_adapter import BatchSettings, Overloaded
from modalgate.encoder_adapter.kimi.adapter import KimiEncoderAdapter
from modalgate.gateway.service.embeds import (
    Embedded,
    rewrite_to_embeds,
    tensor_to_b64,
    unserved_embeds,
)
from modalgate.policy import PolicyError, RuleMatcher, load_policy, parse_policy
from modalgate.policy.models import EmbedsSpec
from modalgate.validators import validate_body
from modalgate.validators.json_body import locate

POLICY = """
models:
  - name: kimi-k3
    match: ["moonshotai/Kimi-K3*"]
    accepts: [image]
    embeds: {}
  - name: qwen2.5-vl
    match: ["Qwen/Qwen2.5-VL-*"]
    accepts: [image, video]
    embeds: {grid_key: image_grid_thw, dtype: bfloat16}
"""
# The rule's server named: vLLM reads its short forms (an image URL without a type).
ON_VLLM = POLICY.replace("    embeds: {}\n", "    embeds: {}\n    engine: vllm\n", 1)


def picture(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


PNG = picture(60, 45, 1)
JPEG = picture(30, 100, 2, "JPEG")


def request_with(*content: dict, model: str = "kimi-k3") -> dict:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You describe images."},
            {"role": "user", "content": list(content)},
        ],
        "max_tokens": 8,
    }


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image(data: bytes, mime: str = "image/png", **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}, **extra}


def verdict_for(request: dict, policy_text: str = POLICY):
    verdict = validate_body(
        orjson.dumps(request), RuleMatcher(parse_policy(policy_text, fmt="yaml"))
    )
    assert verdict.accepted, verdict.violations
    return verdict


def load(b64: str) -> torch.Tensor:
    return torch.load(io.BytesIO(pybase64.b64decode(b64, validate=True)), weights_only=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_embeds")
    save_full_checkpoint(directory)
    return directory


def run(checkpoint, work, **settings):
    """``work(adapter)`` in a fresh loop with a fresh CPU adapter, closed afterwards."""
    adapter = KimiEncoderAdapter(checkpoint, device="cpu", **settings)

    async def main():
        try:
            return await work(adapter)
        finally:
            await adapter.close()

    return asyncio.run(main())


def reference(checkpoint, images: list[bytes]):
    return run(checkpoint, lambda adapter: adapter.encode(images))


def rewrite(checkpoint, verdict, spec: EmbedsSpec, **settings) -> Embedded:
    return run(checkpoint, lambda adapter: rewrite_to_embeds(verdict, adapter, spec), **settings)


def applied(request: dict, embedded: Embedded) -> dict:
    """The request as the gateway forwards it: the rewrite's edits written into a copy."""
    sent = copy.deepcopy(request)
    for location, part in embedded.edits:
        container, key = locate(sent, location)
        container[key] = part
    return orjson.loads(orjson.dumps(sent))


# ---------------------------------------------------------------- the rewrite


def test_images_become_string_form_image_embeds_in_place(checkpoint):
    original = request_with(
        text("first"),
        image(PNG),
        text("between"),
        {"image_url": data_url(JPEG, "image/jpeg")},  # vLLM's short form: no type, a string
        text("last"),
    )
    verdict = verdict_for(copy.deepcopy(original), ON_VLLM)
    spec = verdict.rule.embeds
    assert spec == EmbedsSpec()

    embedded = rewrite(checkpoint, verdict, spec)
    assert embedded.violations == []

    sent = applied(verdict.request, embedded)
    assert verdict.request == original  # the verdict's own request is never changed
    content = sent["messages"][1]["content"]
    assert [part["type"] for part in content] == [
        "text",
        "image_embeds",
        "text",
        "image_embeds",
        "text",
    ]
    for index in (0, 2, 4):
        assert content[index] == original["messages"][1]["content"][index]
    assert sent["messages"][0] == original["messages"][0]
    assert {k: v for k, v in sent.items() if k != "messages"} == {
        "model": "kimi-k3",
        "max_tokens": 8,
    }
    expected = reference(checkpoint, [PNG, JPEG])
    for index, want in zip((1, 3), expected, strict=True):
        assert set(content[index]) == {"type", "image_embeds"}
        assert isinstance(content[index]["image_embeds"], str)  # string form: no grid
        got = load(content[index]["image_embeds"])
        assert got.dtype == torch.float32 and got.ndim == 2
        assert torch.equal(got, want.embedding)


def test_dict_form_carries_the_grid_and_the_dtype(checkpoint):
    request = request_with(image(PNG), text("and"), image(JPEG, "image/jpeg"), model="qwen2.5-vl")
    verdict = verdict_for(request)
    spec = verdict.rule.embeds
    assert spec.grid_key == "image_grid_thw" and spec.dtype == "bfloat16"

    embedded = rewrite(checkpoint, verdict, spec)
    assert embedded.violations == []

    content = applied(verdict.request, embedded)["messages"][1]["content"]
    expected = reference(checkpoint, [PNG, JPEG])
    for part, want in zip((content[0], content[2]), expected, strict=True):
        assert part["type"] == "image_embeds"
        assert set(part["image_embeds"]) == {"image_embeds", "image_grid_thw"}
        embeds = load(part["image_embeds"]["image_embeds"])
        grid = load(part["image_embeds"]["image_grid_thw"])
        assert embeds.dtype == torch.bfloat16
        assert torch.equal(embeds, want.embedding.to(torch.bfloat16))
        assert grid.dtype == torch.int64 and grid.shape == (3,)
        assert torch.equal(grid, torch.tensor(want.grid_thw))
        t, h, w = grid.tolist()
        assert t * h * w // 4 == embeds.shape[0]  # vLLM slices the flat embeds by the grid
    assert content[1] == text("and")


def test_a_bad_image_among_good_ones_is_named_and_nothing_is_rewritten(checkpoint):
    # The gate now refuses this PNG itself (its pixel data is cut short); the encoder's
    # own decode must still name it, should bytes the walk passes fail there: the bytes
    # are swapped in after the verdict, as a decoder the walk does not model would see them.
    broken = png_bomb(40, 40)
    original = request_with(image(PNG), text("x"), image(PNG), image(JPEG, "image/jpeg"))
    verdict = verdict_for(copy.deepcopy(original))
    parts = list(verdict.parts)
    parts[1] = dataclasses.replace(parts[1], data=broken)
    verdict = dataclasses.replace(verdict, parts=tuple(parts))

    embedded = rewrite(checkpoint, verdict, EmbedsSpec())
    violations = embedded.violations

    assert embedded.edits == []
    assert [(v.code.value, v.param) for v in violations] == [
        ("invalid_image", "messages.[1].content.[2].image_url.url")
    ]
    assert violations[0].message.startswith("messages.[1].content.[2].image_url.url: ")
    assert verdict.request == original  # all or nothing: no raw/embeds mix upstream


def test_parts_without_bytes_are_refused_before_encoding(checkpoint):
    original = request_with(
        image(PNG),
        {"type": "input_image", "file_id": "file-abc"},
        {"type": "image_url", "image_url": {"url": "https://images.example.com/a.png"}},
    )
    verdict = verdict_for(copy.deepcopy(original))

    async def work(adapter):
        embedded = await rewrite_to_embeds(verdict, adapter, EmbedsSpec())
        return embedded.violations, adapter.batcher.items

    violations, encoded = run(checkpoint, work)

    assert [(v.code.value, v.param) for v in violations] == [
        ("invalid_request", "messages.[1].content.[1].file_id"),
        ("invalid_request", "messages.[1].content.[2].image_url.url"),
    ]
    assert encoded == 0
    assert verdict.request == original


def test_overload_propagates_and_leaves_the_request(checkpoint):
    original = request_with(image(PNG))
    verdict = verdict_for(copy.deepcopy(original))
    with pytest.raises(Overloaded) as info:
        rewrite(checkpoint, verdict, EmbedsSpec(), batch=BatchSettings(max_queue=0))
    assert info.value.retry_after_s >= 1
    assert verdict.request == original


def test_embeddings_of_the_wrong_width_never_reach_the_upstream(checkpoint):
    original = request_with(text("a"), image(PNG))
    verdict = verdict_for(copy.deepcopy(original))
    width = reference(checkpoint, [PNG])[0].embedding.shape[1]

    violations = rewrite(checkpoint, verdict, EmbedsSpec(hidden_size=width + 1)).violations

    assert [(v.code.value, v.param) for v in violations] == [
        ("encoder_error", "messages.[1].content.[1].image_url.url")
    ]
    assert "shape" not in violations[0].message  # no internals in client text
    assert verdict.request == original
    assert rewrite(checkpoint, verdict, EmbedsSpec(hidden_size=width)).violations == []


def test_the_clients_uuid_and_other_media_stay(checkpoint):
    policy = """
models:
  - name: omni
    accepts: [image, audio]
    embeds: {dtype: float16}
"""
    audio = {"type": "input_audio", "input_audio": {"data": b64(WAV_BYTES), "format": "wav"}}
    original = request_with(image(PNG, uuid="img-1"), audio, model="omni")
    verdict = verdict_for(copy.deepcopy(original), policy)

    embedded = rewrite(checkpoint, verdict, EmbedsSpec(dtype="float16"))
    assert embedded.violations == []

    first, second = applied(verdict.request, embedded)["messages"][1]["content"]
    assert first["uuid"] == "img-1" and first["type"] == "image_embeds"
    assert load(first["image_embeds"]).dtype == torch.float16
    assert second == original["messages"][1]["content"][1]


def test_a_request_without_images_is_left_alone(checkpoint):
    original = request_with(text("only text"))
    verdict = verdict_for(copy.deepcopy(original))
    assert rewrite(checkpoint, verdict, EmbedsSpec()) == Embedded([], [])
    assert verdict.request == original


def test_a_refused_verdict_is_a_wiring_error(checkpoint):
    body = orjson.dumps(request_with({"type": "video_url", "video_url": {"url": "https://a/b"}}))
    verdict = validate_body(body, RuleMatcher(parse_policy(POLICY, fmt="yaml")))
    assert not verdict.accepted
    with pytest.raises(ValueError):
        rewrite(checkpoint, verdict, EmbedsSpec())


# ---------------------------------------------------------------- serialisation


def test_tensor_to_b64_writes_only_the_tensors_own_rows():
    batch = torch.randn(64, 32)
    one = batch[8:12]  # a view into the batch's storage, as per-image outputs are
    b64 = tensor_to_b64(one)
    assert torch.equal(load(b64), one)
    assert len(pybase64.b64decode(b64)) < 4 * 32 * 4 + 2048  # not the 64-row storage
    assert load(tensor_to_b64(one, "bfloat16")).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        tensor_to_b64(one, "no_such_dtype")


def test_the_module_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import modalgate.gateway.service.embeds as m\n"
        "print(m.rewrite_to_embeds.__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "rewrite_to_embeds"


# ---------------------------------------------------------------- policy


def test_a_policy_file_with_embeds_loads(tmp_path):
    file = tmp_path / "policy.yaml"
    file.write_text(
        """
extends: builtin
models:
  - name: qwen2.5-vl
    match: ["qwen2.5-vl", "Qwen/Qwen2.5-VL-*"]
    accepts: [image, video]
    encoder: "kimi:/models/vit"
    embeds:
      format: vllm
      dtype: bfloat16
      grid_key: image_grid_thw
      hidden_size: 3584
""",
        "utf-8",
    )
    policy = load_policy(file)
    rule = RuleMatcher(policy).resolve("Qwen/Qwen2.5-VL-7B-Instruct")
    assert rule.embeds == EmbedsSpec(dtype="bfloat16", grid_key="image_grid_thw", hidden_size=3584)
    assert RuleMatcher(policy).resolve("gpt-4o").embeds is None
    assert RuleMatcher(policy).resolve("no-such-model").embeds is None


@pytest.mark.parametrize(
    ("embeds", "accepts", "field", "text"),
    [
        ("{dtype: int8}", "[image]", "models.[0].embeds.dtype", "'float32', 'bfloat16'"),
        ("{format: sglang}", "[image]", "models.[0].embeds.format", "'vllm'"),
        ("{grid: x}", "[image]", "models.[0].embeds.grid", "Extra inputs"),
        ("{hidden_size: 0}", "[image]", "models.[0].embeds.hidden_size", "greater than 0"),
        ("{grid_key: ''}", "[image]", "models.[0].embeds.grid_key", "at least 1"),
        ("{}", "[image, embeddings]", "models.[0]", "must not accept client 'embeddings'"),
        ("{}", "[video]", "models.[0]", "'embeds' needs 'image'"),
    ],
)
def test_bad_embeds_name_the_field(tmp_path, embeds, accepts, field, text):
    file = tmp_path / "bad.yaml"
    file.write_text(f"models:\n  - name: m\n    accepts: {accepts}\n    embeds: {embeds}\n")
    with pytest.raises(PolicyError) as info:
        load_policy(file)
    [(where, message)] = info.value.problems
    assert where == field
    assert text in message
    assert str(info.value).startswith(f"{file}: {field}: ")


def test_unserved_embeds_name_the_rule():
    policy = parse_policy(
        """
models:
  - {name: own, accepts: [image], encoder: "kimi:/a", embeds: {}}
  - {name: shared, accepts: [image], embeds: {}}
  - {name: plain, accepts: [image]}
  - {name: elsewhere, mode: encoder, accepts: [image], embeds: {}}
""",
        fmt="yaml",
    )
    full = RuleMatcher(policy, "full").rules
    assert unserved_embeds(full, {"kimi:/a"}, default=True) == []
    assert unserved_embeds(full, set(), default=False) == [
        "rule 'own': 'embeds' needs encoder 'kimi:/a', not loaded",
        "rule 'shared': 'embeds' needs an encoder: give the rule 'encoder:'"
        " or start with --encoder",
    ]
    # A rule of another mode is not this gateway's to serve: no --mode is a mode too.
    assert len(unserved_embeds(RuleMatcher(policy, None).rules, set(), default=False)) == 2
    assert len(unserved_embeds(RuleMatcher(policy, "encoder").rules, set(), default=False)) == 3
