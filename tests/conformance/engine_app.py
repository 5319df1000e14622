"""An engine's own app, with the gate on it, served as a process of ``.venv-conformance``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from conformance.differential import ENGINE_PYTHON, ROOT


@contextlib.contextmanager
def serving(
    args: list[str], env: dict[str, str], probe: str, log: Path, port: int
) -> Iterator[str]:
    """``ENGINE_PYTHON ARGS`` with the repository on ``PYTHONPATH``; yields its base URL once
    ``probe`` answers anything (the engine's handlers may fail: no engine runs)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(ENGINE_PYTHON), *args], stdout=out, stderr=subprocess.STDOUT, env=full_env
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine's app did not start:\n{log.read_text()}")
            try:
                httpx.get(base + probe, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(20)
