"""The gate inside vLLM's own app, mounted the one-line way: ``--middleware
modalgate.ModalGate`` read by vLLM's own argument parser, the app made by vLLM's own
``build_app`` (``vllm_app.py``, in ``.venv-conformance``, on the CPU with no model), served
by uvicorn on 127.0.0.1. Every judged vLLM door refuses its fault with the same code and
param as the chat door; a request vLLM would refuse for its API key costs the gate no
fetch.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest
from gateway.test_doors import CASES, judged_doors, send_case

from conformance.differential import ENGINE_PYTHON, ROOT
from conformance.engine_app import serving
from conftest import free_port, image_part

pytestmark = pytest.mark.skipif(
    not ENGINE_PYTHON.exists(),
    reason=f"{ENGINE_PYTHON} is missing: run bash tests/conformance/install.sh",
)
KEY = "vllm-key"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    app = str(ROOT / "tests" / "conformance" / "vllm_app.py")
    args = [app, str(port), "--model", "kimi-k3", "--middleware", "modalgate.ModalGate"]
    env = {"MODALGATE_ENGINE": "vllm"}
    with serving([*args, "--api-key", KEY], env, "/version", log, port) as base:
        assert "middleware, outermost first: ModalGate," in log.read_text()
        yield base


def _post(base: str, path: str, payload: object, key: str | None = KEY) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(base + path, content=orjson.dumps(payload), headers=headers, timeout=30)


def test_every_vllm_door_refuses_the_fault_before_any_handler(vllm_server):
    doors = [(door, kind) for engine, door, kind, _ in judged_doors() if engine == "vllm"]
    assert len(doors) >= 20
    for door, kind in doors:
        fault, code, param, _ = CASES[kind]
        answer = send_case(vllm_server, "POST", door, fault, KEY)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (400, code, param), door


def test_a_clean_body_goes_past_the_gate_to_vllm(vllm_server):
    answer = _post(vllm_server, "/v1/chat/completions", CASES["chat"][3])
    # vLLM's own handler answers (it has no engine here); the gate did not.
    assert "violations" not in answer.text
    assert answer.status_code != 400


def test_a_request_vllm_would_refuse_for_its_key_is_not_judged(vllm_server):
    """Without vLLM's key the body is never read: 401, where with the key the same body is
    judged (its URL refused before any fetch)."""
    request = {
        "model": "kimi-k3",
        "messages": [{"role": "user", "content": [image_part("http://127.0.0.1:9/cat.png")]}],
    }
    for key in (None, "wrong"):
        answer = _post(vllm_server, "/v1/chat/completions", request, key=key)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    judged = _post(vllm_server, "/v1/chat/completions", request).json()["error"]
    assert judged["code"] == "url_not_allowed"
    # /score is a door vLLM does not lock: judged there, key or none.
    fault, code, param, _ = CASES["score"]
    answer = _post(vllm_server, "/score", fault, key=None)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["param"]) == (400, code, param)


def test_inside_vllm_a_reference_to_an_id_this_key_never_sent_is_refused(vllm_server):
    """vLLM would look the id up in its cache and serve whoever filled it: the gate in its
    app answers first, for the one key vLLM was given as for any other."""
    reference = {"type": "image_url", "image_url": None, "uuid": "someone-elses-photo"}
    request = {"model": "kimi-k3", "messages": [{"role": "user", "content": [reference]}]}
    for door in ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"):
        answer = _post(vllm_server, door, request)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (
            400,
            "unknown_media_id",
            "messages.[0].content.[0].uuid",
        ), door
