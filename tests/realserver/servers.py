"""The processes of the real-server differential: ``transformers serve`` twice, the gate once.

- ``TransformersServe``: the ``transformers serve`` command itself, as a user runs it;
  the gate stands in front of this one, and it must outlive the whole gated run.
- ``ForkedServe``: the same server class forked from a process that has imported it
  already (``zygote.py``), for the direct side, where bodies kill it: a restart takes
  ~1 s instead of ~15 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from conftest import free_port
from gateway_proc import GatewayProcess
from realserver.outcomes import Table, post, post_direct, wait_healthy

ZYGOTE = Path(__file__).with_name("zygote.py")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def transformers_command() -> list[str]:
    return [str(Path(sys.executable).with_name("transformers")), "serve"]


class TransformersServe:
    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="tserve-", suffix=".log", delete=False)  # noqa: SIM115
        command = [*transformers_command(), "--device", "cpu", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), str(model_dir)]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}
        )
        wait_healthy(self.url + "/health", 180, self.alive)

    def alive(self) -> bool:
        return self.process.poll() is None

    def text(self) -> str:
        return Path(self.log.name).read_text("utf-8", errors="replace")

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


class ForkedServe:
    def __init__(self, model_dir: Path) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="tserve-forked-", suffix=".log", delete=False)  # noqa: SIM115
        self.zygote = subprocess.Popen(
            [sys.executable, str(ZYGOTE), str(model_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **OFFLINE},
        )
        assert self.zygote.stdout is not None and self.zygote.stdin is not None
        if self.zygote.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the zygote did not start:\n{self.text()}")
        self.pid = 0
        self.restarts = -1
        self.start()

    def start(self) -> None:
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.zygote.stdin.write(f"start {self.port} {self.log.name}\n")
        self.zygote.stdin.flush()
        self.pid = int(self.zygote.stdout.readline().split()[1])
        self.restarts += 1
        wait_healthy(self.url + "/health", 60, self.alive)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        # A zombie (dead, not yet reaped by the zygote) answers kill(0) too.
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        return state not in ("Z", "X")

    def wait_down(self, timeout_s: float = 10.0) -> None:
        """Until a dying server is gone (a crash takes a moment to end the process)."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=0.5)
                return  # it answers: not dying after all
            except httpx.HTTPError:
                time.sleep(0.05)
        self.kill()

    def ensure_up(self) -> None:
        if not self.alive():
            self.start()

    def kill(self) -> None:
        if self.pid and self.alive():
            os.kill(self.pid, signal.SIGKILL)

    def text(self) -> str:
        return Path(self.log.name).read_text("utf-8", errors="replace")

    def stop(self) -> None:
        self.kill()
        assert self.zygote.stdin is not None
        try:
            self.zygote.stdin.write("quit\n")
            self.zygote.stdin.flush()
            self.zygote.wait(10)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.zygote.kill()


def policy_text(model_dir: Path) -> str:
    """The tiny model judged by the built-in ``qwen2-vl`` rule, images only: this server
    loads video with a decoder this machine does not have."""
    return f"""extends: builtin
models:
  - name: tiny-qwen2-vl
    match: ["{model_dir}"]
    accepts: [image]
    message: "this server takes images only (it has no video decoder)"
    limits: {{min_image_side: 28}}
    tokens: {{family: qwen_smart_resize, patch_size: 14, merge_size: 2}}
"""


def gate_in_front(behind: TransformersServe, policy: str, folder: Path) -> GatewayProcess:
    """``modalgate serve`` in front of ``behind``, with ``policy`` (YAML text)."""
    path = folder / "policy.yaml"
    path.write_text(policy)
    return GatewayProcess("--upstream", behind.url, "--policy", str(path)).wait_ready()


def run_differential(
    model_dir: Path,
    behind: TransformersServe,
    gate: GatewayProcess,
    cases: Iterable[tuple[str, dict[str, Any]]],
) -> tuple[Table, int, bool]:
    """Each case straight at a forked server (restarted when a case kills it) and through
    the gate to ``behind``: the table, the direct server's restarts, and whether
    ``behind`` is the same process, alive, at the end."""
    direct = ForkedServe(model_dir)
    pid = behind.process.pid
    table = Table()
    try:
        with httpx.Client(timeout=120) as client:
            for name, body in cases:
                direct_reply = post_direct(client, direct, body)
                gated = post(client, gate.url + "/v1/chat/completions", body, behind.alive)
                table.add(name, direct_reply, gated)
                if not behind.alive():
                    break  # a bypass killed it: the rest would only repeat that
    finally:
        direct.stop()
    print("\n" + table.render() + f"\ndirect restarts: {direct.restarts}")
    return table, direct.restarts, behind.alive() and behind.process.pid == pid
