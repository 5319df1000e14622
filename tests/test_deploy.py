"""The deployment example runs as written: deploy/Dockerfile and deploy/compose.yaml.

Where Docker has no daemon (here), the configuration they describe is built all
the same: every MODALGATE_* variable is a real setting with a valid value, every
flag exists, every COPY source exists, and the compose services' own commands
run as local processes (container paths mapped by the Dockerfile's COPY lines,
service names and ports to 127.0.0.1 and free ports), with a request through the
gateway to the stand-in upstream and the image's health check run against it.
With a daemon the image is built and the services run for real.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from conftest import MP4_BYTES, REPO_ROOT, data_url, free_port
from gateway_proc import GatewayProcess
from modalgate.gateway.cli import _parser
from modalgate.settings import ENV_PREFIX, GatewaySettings, env_name

DEPLOY = REPO_ROOT / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text("utf-8"))
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
SETTING_VARIABLES = {env_name(name): name for name in GatewaySettings.model_fields}
STARTUP_S = 60


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments left out."""
    text = (DEPLOY / "Dockerfile").read_text("utf-8")
    logical = re.sub(r"\\\n\s*", " ", text)
    instructions = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def copies() -> list[tuple[list[str], str]]:
    """Each COPY's sources and destination (flags such as --chown left out)."""
    found = []
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            found.append((parts[:-1], parts[-1]))
    return found


def workdir() -> str:
    return [rest for word, rest in dockerfile_instructions() if word == "WORKDIR"][-1]


def exec_form(rest: str) -> list[str]:
    command = orjson.loads(rest)
    assert isinstance(command, list), f"exec form expected, not {rest!r}"
    return command


def build_context(service: dict[str, Any]) -> Path:
    return (DEPLOY / service["build"]["context"]).resolve()


def serve_flags(command: list[str]) -> list[str]:
    assert command[:2] == ["modalgate", "serve"], command
    return command[1:]


def test_every_copy_source_exists_in_the_build_context():
    context = build_context(SERVICES["gateway"])
    assert context == REPO_ROOT
    for sources, _ in copies():
        for source in sources:
            assert (context / source).exists(), source
    dockerignore = DEPLOY / "Dockerfile.dockerignore"
    kept = {
        line[1:].rstrip("/") for line in dockerignore.read_text().splitlines() if line[:1] == "!"
    }
    assert {source for sources, _ in copies() for source in sources} <= kept


def test_the_image_runs_serve_as_a_non_root_user_with_a_readiness_check():
    instructions = dict(dockerfile_instructions())  # the last of each
    assert re.fullmatch(r"python:3\.\d+-slim", instructions["FROM"])
    assert instructions["USER"] not in ("root", "0")
    command = exec_form(instructions["CMD"])
    args = _parser().parse_args(serve_flags(command))  # every flag exists
    assert args.host == "0.0.0.0"
    assert "/readyz" in instructions["HEALTHCHECK"]
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    assert any(rest.startswith("pip install ") for rest in runs)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_sets_only_real_settings_with_valid_values(name, monkeypatch):
    service = SERVICES[name]
    environment = {str(k): str(v) for k, v in service.get("environment", {}).items()}
    unknown = [k for k in environment if k.startswith(ENV_PREFIX) and k not in SETTING_VARIABLES]
    assert unknown == []
    for variable in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(variable)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    GatewaySettings()  # a bad value raises
    command = service["command"]
    if command[:2] == ["modalgate", "serve"]:
        args = _parser().parse_args(serve_flags(command))
        published = [str(port).rsplit(":", 1)[-1] for port in service.get("ports", [])]
        assert published == [str(args.port)]


def test_the_gateway_points_at_the_upstream_service_on_its_port():
    upstream = httpx.URL(SERVICES["gateway"]["environment"]["MODALGATE_UPSTREAM"])
    assert upstream.host in SERVICES
    command = SERVICES[upstream.host]["command"]
    assert command[command.index("--port") + 1] == str(upstream.port)
    assert str(upstream.port) in [str(p) for p in SERVICES[upstream.host]["expose"]]
    assert SERVICES["gateway"]["depends_on"][upstream.host]["condition"] == "service_healthy"


# ---------------------------------------------------------------- the services as processes


def local_command(command: list[str], ports: dict[str, int], service: str) -> list[str]:
    """The container's command on this machine: its files, this interpreter, 127.0.0.1."""
    into_repo = {}
    for sources, destination in copies():
        for source in sources:
            target = destination
            if not destination.startswith("/"):
                target = f"{workdir()}/{destination.removeprefix('./')}"
            into_repo[target.rstrip("/")] = str(REPO_ROOT / source)
    local = []
    for index, part in enumerate(command):
        if index and command[index - 1] == "--host":
            part = "127.0.0.1"
        elif index and command[index - 1] == "--port":
            part = str(ports[service])
        local.append(into_repo.get(part, part))
    if local[0] == "python":
        local[0] = sys.executable
    elif local[0] == "modalgate":
        local[:1] = [sys.executable, "-m", "modalgate.gateway.cli"]
    return local


def local_environment(environment: dict[str, Any], ports: dict[str, int]) -> dict[str, str]:
    local = {}
    for variable, value in environment.items():
        text = str(value)
        for name, port in ports.items():
            text = re.sub(rf"//{name}:\d+", f"//127.0.0.1:{port}", text)
        local[variable] = text
    return local


def healthcheck(service: dict[str, Any] | None, port: int) -> list[str]:
    """The image's HEALTHCHECK (or the service's own), run here against ``port``."""
    if service is not None and "healthcheck" in service:
        test = service["healthcheck"]["test"]
        command = test[1:]
    else:
        rest = dict(dockerfile_instructions())["HEALTHCHECK"]
        command = exec_form(rest[rest.index("CMD") + 3 :].strip())
    command = [re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", part) for part in command]
    return [sys.executable, *command[1:]] if command[0] == "python" else command


@contextlib.contextmanager
def running_services() -> Iterator[dict[str, GatewayProcess]]:
    ports = {name: free_port() for name in SERVICES}
    processes: dict[str, GatewayProcess] = {}
    try:
        for name in ("upstream", "gateway"):  # depends_on's order
            service = SERVICES[name]
            command = local_command(service["command"], ports, name)
            env = local_environment(service.get("environment", {}), ports)
            process = GatewayProcess(command=command, env=env)
            process.port, process.url = ports[name], f"http://127.0.0.1:{ports[name]}"
            processes[name] = process
            wait_healthy(service if "healthcheck" in service else None, process)
        yield processes
    finally:
        for process in reversed(processes.values()):
            process.__exit__(None, None, None)


def wait_healthy(service: dict[str, Any] | None, process: GatewayProcess) -> None:
    """The health check as the container runs it, retried until it passes (or the process
    ends, or STARTUP_S pass)."""
    command = healthcheck(service, process.port)
    for _ in range(STARTUP_S * 4):
        if process.process.poll() is not None:
            raise RuntimeError(f"exited {process.process.returncode}:\n{process.text()}")
        if subprocess.run(command, capture_output=True, timeout=10).returncode == 0:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.process.wait(0.25)
    raise RuntimeError(f"never healthy:\n{process.text()}")


def test_the_compose_services_run_as_written_and_a_request_goes_through():
    with running_services() as services:
        client = openai.OpenAI(base_url=services["gateway"].url + "/v1", api_key="unused")
        answer = client.chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "hello"}]
        )
        assert answer.choices[0].message.content.startswith("stub upstream: ")
        video = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="kimi-k3", messages=[{"role": "user", "content": [video]}]
            )
        assert (refused.value.code, refused.value.param) == (
            "unsupported_modality",
            "messages.[0].content.[0].type",
        )
        ready = httpx.get(services["gateway"].url + "/readyz").json()
        assert ready["status"] == "ready"


def docker_daemon() -> str | None:
    """Why Docker cannot run here, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return "the docker CLI finds no daemon (docker info failed)"
    return None


def test_with_a_docker_daemon_the_image_builds_and_compose_serves():
    reason = docker_daemon()
    if reason is not None:
        pytest.skip(f"{reason}: the configuration is checked by the tests above instead")
    compose = ["docker", "compose", "-f", str(DEPLOY / "compose.yaml")]
    subprocess.run([*compose, "up", "--build", "--detach", "--wait"], check=True, timeout=900)
    try:
        response = httpx.post(
            "http://127.0.0.1:8000/v1/chat/completions",
            json={"model": "stub", "messages": [{"role": "user", "content": "hello"}]},
            timeout=10,
        )
        assert response.status_code == 200
    finally:
        subprocess.run([*compose, "down"], check=False, timeout=120)
