"""Operating the gateway: policy reload (SIGHUP, file change), settings precedence, other
ASGI servers (hypercorn, granian) serving ``create_app``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import MP4_BYTES, REPO_ROOT, chat, data_url, serve
from gateway_proc import GatewayProcess, metric
from modalgate.gateway.app import StartupError, create_app
from modalgate.gateway.settings import load_settings
from modalgate.policy import load_policy
from modalgate.settings import (
    NOT_IN_POLICY_FILE,
    GatewaySettings,
    ServerSection,
    env_name,
    flag_name,
)
from toy_upstream import ToyUpstream

VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
IMAGE_AND_VIDEO = """\
extends: builtin
models:
  - name: toy-model
    accepts: [image, video]
"""
IMAGE_ONLY = IMAGE_AND_VIDEO.replace("[image, video]", "[image]")
BROKEN = IMAGE_AND_VIDEO.replace("accepts:", "acepts:")


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


def write_atomically(path: Path, text: str) -> None:
    """As config managers do: a new file renamed over the old one."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def video_status(gateway: GatewayProcess) -> int:
    response = httpx.post(gateway.url + "/v1/chat/completions", json=chat(VIDEO, model="toy-model"))
    return response.status_code


def reload_lines(gateway: GatewayProcess, event: str) -> list[dict]:
    return [line for line in gateway.log_lines() if line.get("event") == event]


def wait_reloads(gateway: GatewayProcess, event: str, count: int) -> None:
    gateway.wait_for_log(lambda _: len(reload_lines(gateway, event)) >= count)


def test_sighup_reloads_a_good_policy_and_keeps_the_old_one_for_a_bad_one(upstream, tmp_path):
    _, base = upstream
    policy = tmp_path / "policy.yaml"
    policy.write_text(IMAGE_AND_VIDEO)
    with GatewayProcess(
        "--upstream", base, "--policy", str(policy), "--no-watch-policy"
    ) as gateway:
        assert video_status(gateway) == 200
        write_atomically(policy, IMAGE_ONLY)
        gateway.signal(signal.SIGHUP)
        wait_reloads(gateway, "policy reloaded", 1)
        assert reload_lines(gateway, "policy reloaded")[0]["reason"] == "SIGHUP"
        assert video_status(gateway) == 400

        write_atomically(policy, BROKEN)
        gateway.signal(signal.SIGHUP)
        wait_reloads(gateway, "policy reload refused; the previous policy stays in force", 1)
        refused = reload_lines(gateway, "policy reload refused; the previous policy stays in force")
        assert "acepts" in refused[0]["problems"]
        assert gateway.process.poll() is None
        assert video_status(gateway) == 400  # the image-only policy is still in force
        assert metric(gateway, "modalgate_policy_reloads_total", outcome="ok") == 1
        assert metric(gateway, "modalgate_policy_reloads_total", outcome="error") == 1


def test_a_changed_file_is_reloaded(upstream, tmp_path):
    _, base = upstream
    policy = tmp_path / "policy.yaml"
    policy.write_text(IMAGE_ONLY)
    with GatewayProcess("--upstream", base, "--policy", str(policy)) as gateway:
        assert video_status(gateway) == 400
        write_atomically(policy, IMAGE_AND_VIDEO)
        wait_reloads(gateway, "policy reloaded", 1)
        assert reload_lines(gateway, "policy reloaded")[0]["reason"] == "file changed"
        assert video_status(gateway) == 200


def test_a_reload_that_needs_a_new_encoder_is_refused(upstream, tmp_path):
    _, base = upstream
    policy = tmp_path / "policy.yaml"
    policy.write_text(IMAGE_ONLY)
    with GatewayProcess("--upstream", base, "--policy", str(policy), "--no-watch-policy") as gw:
        write_atomically(policy, IMAGE_AND_VIDEO + "    encoder: kimi:/models/not-loaded\n")
        gw.signal(signal.SIGHUP)
        event = "policy reload refused; the previous policy stays in force"
        wait_reloads(gw, event, 1)
        assert "was not loaded at start" in reload_lines(gw, event)[0]["problems"]
        assert video_status(gw) == 400


def test_settings_precedence_flags_then_environment_then_policy_file(monkeypatch):
    from_policy = {
        "metrics_path": "/m-policy",
        "upstream_read_timeout_s": 7.0,
        "grace_period_s": 3.0,
        "upstream": "http://policy:1",
    }
    monkeypatch.setenv("MODALGATE_METRICS_PATH", "/m-env")
    monkeypatch.setenv("MODALGATE_UPSTREAM_READ_TIMEOUT_S", "8")
    settings = load_settings({"metrics_path": "/m-flag", "grace_period_s": None}, from_policy)
    assert settings.metrics_path == "/m-flag"
    assert settings.upstream_read_timeout_s == 8.0
    assert settings.grace_period_s == 3.0
    assert settings.upstream == "http://policy:1"
    assert settings.port == 8000


def test_policy_server_section_and_environment_configure_serve(upstream, tmp_path):
    _, base = upstream
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"server:\n  upstream: {base}\n  metrics_path: /from-policy\n")
    env = {"MODALGATE_POLICY": str(policy), "MODALGATE_METRICS_PATH": "/from-env"}
    with GatewayProcess(env=env) as gateway:
        assert httpx.get(gateway.url + "/from-env").status_code == 200
        assert (
            httpx.post(
                gateway.url + "/v1/chat/completions", json=chat({"type": "text", "text": "hi"})
            ).status_code
            == 200
        )


def test_bad_settings_exit_2_with_one_line_each(tmp_path):
    gateway = GatewayProcess("--upstream", "ftp://nope", "--metrics-path", "metrics")
    assert gateway.process.wait(30) == 2
    text = gateway.text()
    assert "setting upstream: Value error, the upstream must be an http:// or https:// URL" in text
    assert "setting metrics_path: Value error, must start with /" in text
    assert "Traceback" not in text


SERVERS = {
    "hypercorn": [
        sys.executable,
        "-m",
        "hypercorn",
        "--bind",
        "127.0.0.1:{port}",
        "modalgate.gateway.app:create_app()",
    ],
    "granian": [
        str(Path(sys.executable).with_name("granian")),
        "--interface",
        "asgi",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--workers",
        "1",
        "modalgate.gateway.app:create_app",
    ],
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_other_asgi_servers_serve_create_app(upstream, server):
    _toy, base = upstream
    command = SERVERS[server]
    with GatewayProcess(command=command, env={"MODALGATE_UPSTREAM": base}) as gateway:
        openai_client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
        stream = openai_client.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert [c.choices[0].delta.content for c in stream] == [f"t{i} " for i in range(5)]
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.chat.completions.create(
                model="kimi-k3", messages=[{"role": "user", "content": [VIDEO]}]
            )
        assert caught.value.code == "unsupported_modality"
        assert httpx.get(gateway.url + "/readyz").json()["status"] == "ready"
        # The factory configures the gateway's own JSON log lines under any server.
        line = gateway.wait_for_log(lambda r: r.get("event") == "request_rejected")
        assert line["code"] == "unsupported_modality"


def test_a_validation_service_answers_other_paths_with_not_found():
    with GatewayProcess() as gateway:
        response = httpx.post(gateway.url + "/v1/embeddings", json={"input": "x"})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
        assert response.json()["error"]["type"] == "invalid_request_error"
        hello = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=hello).json()
        assert answer["object"] == "chat.completion"  # a dry run: tests/gateway/test_operators.py
        assert answer["modalgate_verdict"]["object"] == "modalgate.verdict"


def test_a_rule_of_another_mode_never_stops_the_gateway_from_starting(tmp_path):
    # An encoder-mode rule with `embeds` and no encoder is that mode's problem only.
    policy = tmp_path / "modes.yaml"
    policy.write_text(
        "extends: builtin\n"
        "models:\n"
        "  - {name: split-tower, mode: encoder, accepts: [image], embeds: {}}\n",
        encoding="utf-8",
    )
    assert create_app(policy=policy).problems(load_policy(policy)) == []
    with pytest.raises(StartupError, match="split-tower"):
        create_app(policy=policy, mode="encoder")


def test_every_setting_has_its_flag_variable_and_policy_key_in_the_docs():
    # One settings model makes the flags, the MODALGATE_* names and the server: keys.
    table = (REPO_ROOT / "docs" / "deploy.md").read_text("utf-8")
    parser_help = subprocess.run(
        [sys.executable, "-m", "modalgate.gateway.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in GatewaySettings.model_fields:
        rows = (line for line in table.splitlines() if line.startswith("| `--"))
        row = next((line for line in rows if f"`{env_name(name)}`" in line), "")
        assert row.startswith(f"| `{flag_name(name)}"), name
        assert flag_name(name) in parser_help, name
        key = "—" if name in NOT_IN_POLICY_FILE else f"`{name}`"
        assert f"| {key} |" in row, name
        if name not in NOT_IN_POLICY_FILE:
            assert name in ServerSection.model_fields


def test_check_refuses_a_server_section_that_serve_would_refuse(tmp_path):
    policy = tmp_path / "bad-server.yaml"
    policy.write_text("server: {upstream: 'ftp://x', metrics_path: metrics}\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "modalgate.gateway.cli", "check", str(policy)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "server.upstream: the upstream must be an http:// or https:// URL" in result.stderr
    assert "server.metrics_path: must start with /" in result.stderr


def write_as_kubelet(directory: Path, text: str, generation: int) -> None:
    """As a ConfigMap volume is updated: the file is a link through ``..data``, which is
    swapped (by rename) to a new timestamped directory holding the new file."""
    version = directory / f"..2026_12_07_{generation}"
    version.mkdir()
    (version / "policy.yaml").write_text(text)
    link = directory / "..data_tmp"
    link.symlink_to(version.name)
    os.replace(link, directory / "..data")
    if not (directory / "policy.yaml").is_symlink():
        (directory / "policy.yaml").symlink_to("..data/policy.yaml")


def test_a_configmap_update_is_reloaded(upstream, tmp_path):
    _, base = upstream
    write_as_kubelet(tmp_path, IMAGE_ONLY, 1)
    policy = tmp_path / "policy.yaml"
    with GatewayProcess("--upstream", base, "--policy", str(policy)) as gateway:
        assert video_status(gateway) == 400
        write_as_kubelet(tmp_path, IMAGE_AND_VIDEO, 2)
        wait_reloads(gateway, "policy reloaded", 1)
        assert video_status(gateway) == 200
