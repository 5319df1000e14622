"""The gate in front of a real model server: ``transformers serve`` on a tiny Qwen2-VL.

The model (weights, processor, tokenizer, chat template) is built here and saved
with ``save_pretrained``; the server loads it as a user's checkpoint. Every corpus
body (``bodies.py``, generated) goes straight to a server that is restarted whenever
a body kills it, and through ``modalgate serve`` to another that must survive them
all. Acceptance, as the issue states it: no bypass, no gate 5xx, the server behind
the gate alive at the end, and every false reject one made on purpose
(``expected.py``, docs/conformance.md).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

from gateway_proc import GatewayProcess
from realserver.bodies import corpus
from realserver.expected import ON_PURPOSE, reason_for
from realserver.outcomes import Table
from realserver.servers import TransformersServe, gate_in_front, policy_text, run_differential
from realserver.tiny_vlm import build_qwen2_vl

DOCS = Path(__file__).parents[2] / "docs" / "conformance.md"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="module")
def behind(model_dir: Path) -> Iterator[TransformersServe]:
    server = TransformersServe(model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gate(model_dir: Path, behind: TransformersServe, tmp_path_factory) -> Iterator[GatewayProcess]:
    process = gate_in_front(behind, policy_text(model_dir), tmp_path_factory.mktemp("policy"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def differential(
    model_dir: Path, behind: TransformersServe, gate: GatewayProcess
) -> tuple[Table, int, bool]:
    return run_differential(model_dir, behind, gate, corpus(str(model_dir)))


def test_no_body_gets_past_the_gate_to_hurt_the_server(differential):
    table, restarts, behind_alive = differential
    assert behind_alive, "a body through the gate killed the server:\n" + table.render()
    assert len(table.rows) >= 300
    assert table.of("bypass") == [], table.render()
    assert table.of("gate 5xx") == [], table.render()
    assert table.of("differ") == [], table.render()
    # The differential has teeth: the server dies of some bodies, answers 500 to others.
    assert restarts >= 10
    assert len(table.of("protected")) >= 100
    assert len(table.of("both fine")) >= 50


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("png-row-short-32", "invalid_image"),
        ("png-filter-invalid-200", "invalid_image"),
        ("png-zlib-corrupt-64", "invalid_image"),
        ("png-stream-no-final-block-64", "invalid_image"),
        ("png-adler-bad-32", "invalid_image"),
        ("jpeg-scan-corrupt", "invalid_image"),
        ("format-TIFF-64x48", "unsupported_image_format"),
        ("part-video_url", "unsupported_modality"),
    ],
)
def test_what_hurts_the_server_is_refused_with_its_code(differential, case, code):
    table = differential[0]
    (row,) = [row for row in table.rows if row[0] == case]
    name, direct, gated, kind = row
    assert direct.failed, (name, direct)
    assert (kind, gated.status, gated.code) == ("protected", 400, code)
    assert gated.param is not None and gated.param.startswith("messages.[0].content.[1]")


def test_every_false_reject_is_one_made_on_purpose_and_documented(differential):
    table = differential[0]
    unexplained = [
        (name, gated.code)
        for name, _, gated, _ in table.of("false reject")
        if reason_for(name, gated.code) is None
    ]
    assert unexplained == []
    documented = DOCS.read_text("utf-8")
    for key in ON_PURPOSE:
        assert f"`{key}`" in documented, key


def test_a_png_lacking_only_iend_reaches_the_model(differential):
    rows = {name: kind for name, _, _, kind in differential[0].rows}
    assert {rows[f"png-no-iend-{side}"] for side in (32, 64, 200)} == {"both fine"}


def test_the_openai_client_through_the_gate_to_the_real_server(gate, model_dir):
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    client = openai.OpenAI(base_url=gate.url + "/v1", api_key="none", max_retries=0)
    content = [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    answer = client.chat.completions.create(
        model=str(model_dir), messages=[{"role": "user", "content": content}], max_tokens=3
    )
    assert answer.choices[0].message.content is not None
    assert answer.usage is not None and answer.usage.prompt_tokens > 10
    video = {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=str(model_dir), messages=[{"role": "user", "content": [video]}], max_tokens=3
        )
    assert refused.value.code == "unsupported_modality"
    assert refused.value.param == "messages.[0].content.[0].type"
