"""The gate inside SGLang's own app (``modalgate.gateway.sglang``), served as SGLang's
multi-process tokenizer mode serves it: uvicorn with two workers, each importing the app
anew by its import path (``SGLANG_HTTP_SERVER_APP_PATH``). SGLang's app is its own
(``sglang.srt.entrypoints.http_server``, in ``.venv-conformance``); no engine is started,
so the gate's answers come before any handler runs. Every judged SGLang door, on POST and
PUT, refuses its fault with the chat door's code and param, in whichever worker answers.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from gateway.test_doors import CASES, judged_doors, send_case

from conformance.differential import ENGINE_PYTHON, ROOT
from conformance.engine_app import serving
from conftest import free_port

pytestmark = pytest.mark.skipif(
    not ENGINE_PYTHON.exists(),
    reason=f"{ENGINE_PYTHON} is missing: run bash tests/conformance/install.sh",
)


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    folder = tmp_path_factory.mktemp("sglang")
    policy = folder / "policy.yaml"
    policy.write_text("extends: builtin\ndefault_model: kimi-k3\n", encoding="utf-8")
    env = {"MODALGATE_ENGINE": "sglang", "MODALGATE_POLICY": str(policy)}
    # The app path SGLANG_HTTP_SERVER_APP_PATH names, as the launcher sets it.
    uvicorn = ["-m", "uvicorn", "modalgate.gateway.sglang:app", "--port", str(port)]
    flags = ["--workers", "2", "--lifespan", "off", "--log-level", "warning"]
    with serving([*uvicorn, *flags], env, "/model_info", folder / "server.log", port) as base:
        yield base


def test_every_sglang_door_refuses_the_fault_in_every_worker(sglang_server):
    doors = [(door, kind, method) for e, door, kind, method in judged_doors() if e == "sglang"]
    assert len(doors) >= 20
    for _ in range(3):  # each door asked three times: both workers answer some
        for door, kind, method in doors:
            fault, code, param, _ = CASES[kind]
            answer = send_case(sglang_server, method, door, fault)
            error = answer.json()["error"]
            assert (answer.status_code, error["code"], error["param"]) == (400, code, param), (
                method,
                door,
            )


def test_the_launcher_adds_the_gate_then_runs_sglangs_own_argument_parser():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(ENGINE_PYTHON), "-m", "modalgate.gateway.sglang", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--model-path" in done.stdout
