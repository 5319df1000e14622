"""``modalgate serve`` as a real process for the tests: start, wait until healthy, read logs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port

MODALGATE = [sys.executable, "-m", "modalgate.gateway.cli"]


class GatewayProcess:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, command: list[str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
            prefix="modalgate-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log.name)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if command is None:
            command = [*MODALGATE, "serve", "--port", str(self.port), *args]
        else:
            command = [part.replace("{port}", str(self.port)) for part in command]
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=full_env
        )

    def wait_ready(self, timeout_s: float = 30.0) -> GatewayProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited {self.process.returncode}:\n{self.text()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the gateway did not start:\n{self.text()}")

    def text(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(orjson.JSONDecodeError):
                    lines.append(orjson.loads(line))
        return lines

    def wait_for_log(self, predicate, timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_lines():
                if predicate(line):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no such log line in:\n{self.text()}")

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> GatewayProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def raw_http(gateway: GatewayProcess, request: bytes) -> bytes:
    """One request as bytes on a fresh socket (no client library adding its own headers
    or tidying the path), and the whole answer as bytes."""
    url = httpx.URL(gateway.url)
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer
