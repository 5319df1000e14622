"""``modalgate serve --workers N``: worker processes on one port, one ``/metrics`` for all."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from conftest import chat, serve
from gateway_proc import GatewayProcess, metric
from modalgate.gateway.http.server import settings_environment
from modalgate.settings import GatewaySettings
from toy_upstream import ToyUpstream

MAX_REQUESTS = 200  # until both workers have answered: far more than ever needed
STARTUP_S = 120


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve(ToyUpstream().app()) as base:
        yield base


def requests_by_worker(metrics_dir: Path) -> dict[str, float]:
    """Each worker's own count of accepted chat requests, read from its own file."""
    counts = {}
    for file in metrics_dir.glob("counter_*.db"):
        pid = file.stem.removeprefix("counter_")
        families = MultiProcessCollector.merge([str(file)], accumulate=True)
        counts[pid] = sum(
            sample.value
            for family in families
            for sample in family.samples
            if sample.name == "modalgate_requests_total" and sample.labels["outcome"] == "accepted"
        )
    return counts


def test_metrics_count_every_workers_requests_whichever_answers(upstream, tmp_path):
    env = {"TMPDIR": str(tmp_path)}  # where the parent makes the metrics directory
    gateway = GatewayProcess("--workers", "2", "--upstream", upstream, env=env)
    try:  # three interpreters start (the parent, two workers): on a loaded machine, a while
        gateway.wait_ready(STARTUP_S)
    except RuntimeError:
        gateway.stop()
        raise
    with gateway:
        [metrics_dir] = tmp_path.glob("modalgate-metrics-*")
        sent = 0
        while sent < MAX_REQUESTS:
            # A new connection each time: the kernel hands it to either worker.
            response = httpx.post(gateway.url + "/v1/chat/completions", json=chat())
            assert response.status_code == 200
            sent += 1
            by_worker = requests_by_worker(metrics_dir)
            if len([count for count in by_worker.values() if count]) == 2:
                break
        assert sum(by_worker.values()) == sent
        assert len(by_worker) == 2 and all(by_worker.values()), by_worker
        for _ in range(6):  # each scrape on a new connection, so both workers answer some
            assert metric(gateway, "modalgate_requests_total", outcome="accepted") == sent
    assert not metrics_dir.exists(), "the parent removes the directory when the workers are gone"


def test_workers_read_back_the_settings_the_parent_resolved(monkeypatch):
    settings = GatewaySettings(
        upstream="http://10.0.0.5:8000/v1",
        enforce=False,
        workers=3,
        grace_period_s=2.5,
        api_keys="k1,k2",
    )
    environment = settings_environment(settings)
    assert environment["MODALGATE_UPSTREAM"] == "http://10.0.0.5:8000"
    assert environment["MODALGATE_ENFORCE"] == "false"
    assert environment["MODALGATE_API_KEYS"] == "k1,k2"
    assert "MODALGATE_POLICY" not in environment  # unset stays unset
    for name in [n for n in os.environ if n.startswith("MODALGATE_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert GatewaySettings() == settings


def test_a_worker_that_cannot_start_stops_serve_with_its_one_line():
    gateway = GatewayProcess("--workers", "2", "--encoder", "no-such-encoder")
    assert gateway.process.wait(STARTUP_S) == 2
    text = gateway.text()
    assert "cannot start the encoder: no encoder named 'no-such-encoder'" in text
    assert "Traceback" not in text
    gateway.stop()
    gateway.log_path.unlink(missing_ok=True)
