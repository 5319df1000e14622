"""W1: ``modalgate serve --workers 2`` against ``--workers 1``, side by side in one run.

One upstream (P6's minimal OpenAI-compatible server, 1 uvicorn worker, a
service time of 20 ms before each answer: P6's stress point, where one gateway
process is CPU-bound) and two gateways in front of it, started together with
the built-in policy, ``--log-level warning --no-access-log``: one with
``--workers 1``, one with ``--workers 2`` (Prometheus multiprocess metrics on,
as ``serve`` sets them up). Nothing is pinned: the point is the second core.

Throughput: wrk (``-t1 -c64``, P1's ~300-byte text-only kimi-k3 body) at each
gateway in turn, in interleaved rounds (1w, 2w | 2w, 1w | ...: the order flips
every round so drift on a shared machine cancels). Ratio = 2-worker req/s ÷
1-worker req/s per round; the median and the spread are reported, with the
CPU each gateway's process tree (parent and workers) spent per request, and
the load average (other work on the machine takes the second core away).
Before the rounds each gateway is checked: both answer the body alike, both
refuse a video part, and the 2-worker gateway's ``/metrics`` counts every
request of a burst on new connections (whichever worker took each).

Usage: .venv/bin/python benchmarks/w1_workers.py [--quick] [--rounds N]
       [--seconds S] [--connections C]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import p6_proxy_overhead as p6
from _common import machine_line, result_line, spread, table
from _peers import tree_cpu_seconds
from _servers import PATH, ServerProcess, check_gate_in_path
from p1_middleware_overhead import REQUEST_BODY, WRK_LUA
from p6_proxy_overhead import run_wrk, start_upstream, stopping

NAME = "w1_workers"
TARGET = 1.3  # two workers must put the second core to use
SERVICE_MS = 20.0
STARTUP_S = 120.0  # three interpreters start for the 2-worker gateway


def start_gateway(upstream: ServerProcess, workers: int) -> ServerProcess:
    name = f"gateway, {workers} worker(s)"
    return p6.start_gateway(upstream, None, "--workers", str(workers), name=name)


def wait_serving(gateway: ServerProcess) -> None:
    """Until ``/healthz`` answers: the 2-worker parent listens before its workers serve."""
    deadline = time.monotonic() + STARTUP_S
    url = f"http://127.0.0.1:{gateway.port}/healthz"
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise RuntimeError(f"{gateway.name} exited with {gateway.process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{gateway.name} did not serve within {STARTUP_S:g} s")


def accepted_count(gateway: ServerProcess) -> float:
    url = f"http://127.0.0.1:{gateway.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("modalgate_requests_total{") and 'outcome="accepted"' in line
    )


def check_metrics_span_workers(gateway: ServerProcess, requests: int = 40) -> None:
    """A burst on new connections (so both workers take some): every one is counted."""
    before = accepted_count(gateway)
    for _ in range(requests):
        status, _ = gateway.post(REQUEST_BODY.encode())
        assert status == 200, status
    for _ in range(4):  # each scrape reaches either worker
        counted = accepted_count(gateway) - before
        assert counted == requests, (counted, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~1 min)")
    parser.add_argument("--rounds", type=int, default=None, help="wrk rounds")
    parser.add_argument("--seconds", type=float, default=None, help="wrk duration per run")
    parser.add_argument("--connections", type=int, default=64, help="wrk -c, both arms")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 6)
    seconds = args.seconds or (3.0 if args.quick else 8.0)
    warm_up = 1.0 if args.quick else 3.0

    print(f"== {NAME}")
    print(machine_line())
    if shutil.which("wrk") is None:
        print("wrk not found; cannot run")
        print(result_line(NAME, 0.0, f">= {TARGET}", False))
        return
    print(
        f"upstream 1 worker, {SERVICE_MS:g} ms service time; gateways --workers 1 and "
        f"--workers 2, no access log, log level warning; wrk -t1 -c{args.connections} "
        f"-d{seconds:g}s, {rounds} round(s) after a {warm_up:g} s warm-up of each; nothing pinned"
    )
    print(f"request: POST {PATH}, {len(REQUEST_BODY)} bytes, text-only, model kimi-k3")

    ratios: list[float] = []
    rows: list[tuple[object, ...]] = []
    cpu_us: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp, stopping([]) as processes:
        script = str(Path(tmp) / "post.lua")
        Path(script).write_text(WRK_LUA.format(body=REQUEST_BODY))
        upstream = start_upstream(SERVICE_MS, None)
        processes.append(upstream)
        gateways = {n: start_gateway(upstream, n) for n in (1, 2)}
        processes.extend(gateways.values())
        upstream.wait_ready()
        for gateway in gateways.values():
            wait_serving(gateway)
            check_gate_in_path(upstream, gateway, REQUEST_BODY.encode())
        check_metrics_span_workers(gateways[2])
        for gateway in gateways.values():
            run_wrk(gateway.url, script, warm_up, args.connections, None)
        for r in range(rounds):
            rates: dict[int, float] = {}
            for n in (1, 2) if r % 2 == 0 else (2, 1):
                gateway = gateways[n]
                before = tree_cpu_seconds(gateway.process.pid)
                run = run_wrk(gateway.url, script, seconds, args.connections, None)
                spent = tree_cpu_seconds(gateway.process.pid) - before
                cpu_us[n].append(spent / max(run.requests, 1) * 1e6)
                rates[n] = run.rate
            ratios.append(rates[2] / rates[1])
            load = os.getloadavg()[0]
            rows.append((r + 1, rates[1], rates[2], ratios[-1], load))

    print(table(("round", "1 worker req/s", "2 workers req/s", "ratio", "load 1m"), rows))
    ratio = statistics.median(ratios)
    print(
        f"gateway CPU per request (median over rounds, parent and workers): "
        f"1 worker {statistics.median(cpu_us[1]):.0f} us, "
        f"2 workers {statistics.median(cpu_us[2]):.0f} us"
    )
    print(f"\nthroughput 2 workers ÷ 1 at -c{args.connections}: {ratio:.2f} ({spread(ratios)})")
    print(result_line(NAME, ratio, f">= {TARGET}", ratio >= TARGET))


if __name__ == "__main__":
    main()
