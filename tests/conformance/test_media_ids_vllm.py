"""Media ids against vLLM's own cache keys: the bodies the gate forwards for two tenants are
handed to vLLM's own parsing and hashing (``vllm_mm_hashes.py`` in ``.venv-conformance``,
a tiny Qwen2-VL built here), and the keys vLLM would cache under are compared. Under the
default ``bind`` no key of one tenant's is ever another's, an id reused for other bytes never
keys the old entry, and a tenant's reference keys exactly its own fill; under ``share``
identical bytes share one key. The client's raw bodies, for contrast, collide as
vllm-project/vllm#55547 and #53471 describe.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from conformance.differential import ENGINE_PYTHON, ROOT
from conftest import data_url, noise_png
from modalgate import ModalGate
from modalgate.policy import parse_policy

pytestmark = pytest.mark.skipif(
    not ENGINE_PYTHON.exists(),
    reason=f"{ENGINE_PYTHON} is missing: run bash tests/conformance/install.sh",
)
ENGINE_MODEL = "Qwen/Qwen2-VL-2B-Instruct"  # the --model string vLLM hashes with
RED, BLUE = noise_png(56, 56, 21), noise_png(56, 56, 22)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from realserver.tiny_vlm import build_qwen2_vl

    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))


def vllm_keys(model_dir: Path, bodies: list[dict[str, Any]]) -> list[list[str]]:
    """Per body, every key vLLM caches its media under (all modalities, in order)."""
    script = ROOT / "tests" / "conformance" / "vllm_mm_hashes.py"
    done = subprocess.run(
        [str(ENGINE_PYTHON), str(script), str(model_dir), ENGINE_MODEL],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hashes = json.loads(done.stdout.strip().splitlines()[-1])
    return [[key for keys in per_body.values() for key in keys] for per_body in hashes]


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "qwen2-vl", "messages": [{"role": "user", "content": list(parts)}]}


def part(data: bytes | None, media_id: str | None) -> dict[str, Any]:
    built: dict[str, Any] = {
        "type": "image_url",
        "image_url": {"url": data_url(data)} if data is not None else None,
    }
    if media_id is not None:
        built["uuid"] = media_id
    return built


class Tenants:
    """One gate (as ``modalgate serve --engine vllm`` makes it), asked as two API keys."""

    def __init__(self, policy: str = "") -> None:
        loaded = parse_policy(f"extends: builtin\n{policy}", fmt="yaml")
        self.gate = ModalGate(_unused, policy=loaded, engine="vllm", api_keys=())

    def forward(self, key: str, body: dict[str, Any]) -> dict[str, Any] | str:
        """The body the engine would get, or the refusal's code."""
        headers = [(b"authorization", f"Bearer {key}".encode())]
        decision = asyncio.run(
            self.gate.decider.decide(orjson.dumps(body), "chat", None, None, headers)
        )
        if not decision.forwards:
            return decision.verdict.violations[0].code.value
        return orjson.loads(decision.body)


async def _unused(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError


def test_bound_bodies_never_share_vllms_keys_across_tenants_or_contents(model_dir):
    tenants = Tenants()
    a_red = tenants.forward("a", chat(part(RED, "photo")))
    assert tenants.forward("b", chat(part(None, "photo"))) == "unknown_media_id"
    b_red = tenants.forward("b", chat(part(RED, "photo")))
    a_blue = tenants.forward("a", chat(part(BLUE, "photo")))
    a_ref = tenants.forward("a", chat(part(None, "photo")))
    b_ref = tenants.forward("b", chat(part(None, "photo")))
    bodies = [a_red, b_red, a_blue, a_ref, b_ref]
    assert all(isinstance(body, dict) for body in bodies)
    (a_red_key,), (b_red_key,), (a_blue_key,), (a_ref_key,), (b_ref_key,) = vllm_keys(
        model_dir, bodies
    )
    assert len({a_red_key, b_red_key, a_blue_key}) == 3  # tenants apart, contents apart
    assert a_ref_key == a_blue_key  # a reference keys its tenant's latest fill
    assert b_ref_key == b_red_key
    assert "photo" not in {a_red_key, b_red_key, a_blue_key}


def test_the_clients_own_bodies_collide_in_vllm_as_the_issues_say(model_dir):
    """For contrast: what vLLM keys the same requests on without the gate."""
    raw = [chat(part(RED, "photo")), chat(part(BLUE, "photo")), chat(part(None, "photo"))]
    assert vllm_keys(model_dir, raw) == [["photo"], ["photo"], ["photo"]]


def test_share_keys_identical_bytes_alike_and_nothing_else(model_dir):
    tenants = Tenants("media_ids: {mode: share}")
    bodies = [
        tenants.forward("a", chat(part(RED, "photo"))),
        tenants.forward("b", chat(part(RED, "mine"))),
        tenants.forward("b", chat(part(BLUE, "photo"))),
    ]
    (a,), (b,), (other,) = vllm_keys(model_dir, bodies)
    assert a == b != other


def test_strip_leaves_vllm_its_own_content_hash(model_dir):
    tenants = Tenants("media_ids: {mode: strip}")
    stripped = tenants.forward("a", chat(part(RED, "photo")))
    (key,), (content_key,) = vllm_keys(model_dir, [stripped, chat(part(RED, None))])
    assert key == content_key != "photo"


def test_isolate_keeps_identical_bytes_without_ids_apart(model_dir):
    """Without ids vLLM keys identical bytes alike for everyone (its content hash); under
    ``isolate`` each tenant's get a key of their own, and the same tenant's stay one."""
    tenants = Tenants("media_ids: {mode: isolate}")
    raw = chat(part(RED, None))
    bodies = [tenants.forward("a", raw), tenants.forward("b", raw), tenants.forward("a", raw)]
    (a,), (b,), (a_again,) = vllm_keys(model_dir, bodies)
    ((content,),) = vllm_keys(model_dir, [raw])
    assert a != b and a == a_again and content not in (a, b)
