"""Server processes for the HTTP benchmarks (P1, P6): start, wait, post, CPU time, stop."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PATH = "/v1/chat/completions"
VIDEO_REQUEST = {
    "model": "kimi-k3",
    "messages": [
        {
            "role": "user",
            "content": [{"type": "video_url", "video_url": {"url": "https://x.test/a.mp4"}}],
        }
    ],
}


def scope_for(body: bytes) -> dict[str, Any]:
    """What uvicorn hands an app for ``POST /v1/chat/completions`` from a wrk-like client."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "state": {},
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pin(cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu)] if cpu is not None else []


def uvicorn_command(factory: str, app_dir: Path, port: int, cpu: int | None) -> list[str]:
    """One uvicorn worker serving ``module:factory`` from ``app_dir``, quietly."""
    return [
        *pin(cpu),
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        factory,
        "--app-dir",
        str(app_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--no-access-log",
        "--log-level",
        "warning",
    ]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when this script dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server subprocess on 127.0.0.1:port; stopped by ``stop()`` (and with this script)."""

    def __init__(
        self, name: str, command: list[str], port: int, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}{PATH}"
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.process = subprocess.Popen(command, env=env, preexec_fn=preexec)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start within {timeout:g} s")

    def post(self, body: bytes) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process (Linux /proc; 0 elsewhere)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def check_gate_in_path(plain: ServerProcess, gated: ServerProcess, body: bytes) -> None:
    """Both answer ``body`` alike, and the gated one refuses a video part (the gate is there)."""
    status_plain, answer_plain = plain.post(body)
    status_gated, answer_gated = gated.post(body)
    assert status_plain == status_gated == 200, (status_plain, status_gated)
    assert answer_plain == answer_gated and answer_plain["model"] == "kimi-k3"
    status, answer = gated.post(json.dumps(VIDEO_REQUEST).encode())
    assert status == 400 and answer["error"]["code"] == "unsupported_modality", (status, answer)
