"""A second model family behind the gate: ``transformers serve`` on a tiny LLaVA.

The same differential as ``test_real_server.py`` (Qwen2-VL), on another processor
(CLIP resize and crop, a fixed 16 image tokens) and another chat template: the image
cases that reach the server's decoder (pixel corruption, truncation, formats, JPEG,
polyglots) go straight to a ``transformers serve`` restarted whenever one kills it,
and through ``modalgate serve`` to another that must survive them all. No built-in
rule covers LLaVA, so the policy names one for the model here: images only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_proc import GatewayProcess
from realserver.bodies import corpus
from realserver.expected import reason_for
from realserver.outcomes import Table
from realserver.servers import TransformersServe, gate_in_front, run_differential
from realserver.tiny_llava import IMAGE_SIDE, IMAGE_TOKENS, PATCH, build_llava

PREFIXES = ("png-", "truncated-", "format-", "jpeg-", "polyglot-")


def llava_policy(model_dir: Path) -> str:
    return f"""extends: builtin
models:
  - name: tiny-llava
    match: ["{model_dir}"]
    accepts: [image]
    message: "this LLaVA takes images only"
    tokens: {{family: fixed, patch_size: {PATCH}, tile_size: {IMAGE_SIDE},
              tokens_per_image: {IMAGE_TOKENS}}}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def behind(model_dir: Path) -> Iterator[TransformersServe]:
    server = TransformersServe(model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gate(model_dir: Path, behind: TransformersServe, tmp_path_factory) -> Iterator[GatewayProcess]:
    process = gate_in_front(behind, llava_policy(model_dir), tmp_path_factory.mktemp("policy"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def differential(
    model_dir: Path, behind: TransformersServe, gate: GatewayProcess
) -> tuple[Table, int, bool]:
    cases = [(name, body) for name, body in corpus(str(model_dir)) if name.startswith(PREFIXES)]
    return run_differential(model_dir, behind, gate, cases)


def test_llava_behind_the_gate_survives_the_image_corpus(differential):
    table, _restarts, behind_alive = differential
    assert behind_alive, "a body through the gate killed the server:\n" + table.render()
    assert len(table.rows) >= 50
    assert table.of("bypass") == [], table.render()
    assert table.of("gate 5xx") == [], table.render()
    unexplained = [
        (name, gated.code)
        for name, _, gated, _ in table.of("false reject")
        if reason_for(name, gated.code) is None
    ]
    assert unexplained == [], table.render()
    # The gated side reaches the model: plain images come back 200 through the gate.
    assert len(table.of("both fine")) >= 10, table.render()
