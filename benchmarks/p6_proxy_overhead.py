"""P6: P1 again through the proxy: ``modalgate serve --upstream`` + upstream vs the upstream alone.

The upstream is a minimal OpenAI-compatible server: a Starlette app in its own
uvicorn process (1 worker, ``--no-access-log``, log level warning), started
with ``--factory`` from this script. ``POST /v1/chat/completions`` parses the
body and, after ``await asyncio.sleep(service_ms / 1000)`` (a model server's
service time: even a small model takes milliseconds per request), answers a
small ``chat.completion`` JSON, or with ``"stream": true`` an SSE stream of N
``chat.completion.chunk`` events (a gap between them) and ``data: [DONE]``.
The gateway is ``python -m modalgate.gateway.cli serve --upstream URL --port P
--log-level warning --no-access-log`` with the built-in policy, in its own
process: the real ``modalgate serve`` stack (RequestId -> ModalGate -> router
-> UpstreamProxy, one pooled aiohttp client per upstream: gateway/upstream/pool.py).

Throughput: wrk (``-t1 -c32``, same ~300-byte text-only kimi-k3 body and Lua
script as P1) at the upstream directly and at the gateway in turn, in
interleaved rounds (direct, proxied | proxied, direct | ...: the order flips
every round so drift on a shared machine cancels). Ratio = proxied req/s ÷
direct req/s per round, at the same wrk concurrency; the median and the spread
(min..max over rounds) are reported. Any non-2xx response or socket error in
either arm stops the benchmark. Three scenarios, each with its own upstream
and gateway pair:

(a) service time 100 ms: the headline, target >= 0.85. A model server takes at
    least this long for the shortest chat completion (a prefill and a few
    decode steps), so this is the lightest load a real upstream puts on a
    gateway at this concurrency: ~32 / 100 ms requests per second.
(b) service time 20 ms: a stress point, reported with no target. The direct
    arm then runs at ~1,300 req/s, so the gateway must spend under ~0.65 ms of
    one core per request to keep up; a Python gateway that is an HTTP server
    and an HTTP client (uvicorn + aiohttp) spends more (see the CPU per
    request printed), so this ratio is its CPU bound, not its added latency.
(c) service time 0 ms: the worst case for any proxy, reported with no target.
    The upstream then does nothing but HTTP, so the gateway (which speaks
    HTTP twice per request and validates the body in between) costs more CPU
    per request than the upstream itself; the ratio is roughly the upstream's
    CPU per request over the gateway's, not a property of a real deployment.
The CPU each process spent per request is printed for every scenario; that,
and the streamed latency below, are the gateway's real cost.

Pinning (taskset, when there are 2+ cores; ``--no-pin`` to leave it): the
upstream alone on core 1, the gateway and wrk (and this script) on core 0.
The upstream stands for the model server, which has its own resources; it gets
the same core in both arms, so the ratio measures what putting the gateway in
the path costs, not the gateway taking CPU away from the model server. wrk is
event-driven C and needs a small share of core 0 in the direct arm; in the
proxied arm it shares that core with the gateway, as a client-side gateway
process would share a host with other work.

Streamed latency: this script, pinned to core 0, sends N streamed requests
one at a time with a keep-alive ``httpx.Client``, alternating direct and
proxied (order flipped every pair), to the scenario (b) upstream (20 ms before
the first chunk, then 8 chunks 5 ms apart). Per request: time to the first
body bytes (time to first token) and to the end of the stream, with each
response checked (8 chunks and ``[DONE]``). Printed: p50 and p99 of both for
each arm, and the latency the gateway adds (proxied minus direct) at p50 and
p99.

Usage: .venv/bin/python benchmarks/p6_proxy_overhead.py [--quick] [--rounds N]
       [--seconds S] [--connections C] [--requests N] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import machine_line, result_line, spread, table
from _servers import PATH, ServerProcess, check_gate_in_path, free_port, pin, uvicorn_command
from p1_middleware_overhead import COMPLETION, REQUEST, REQUEST_BODY, WRK_LUA

NAME = "p6_proxy_overhead"
TARGET = 0.85
HERE = Path(__file__).resolve().parent
HEADLINE_SERVICE_MS = 100.0
STRESS_SERVICE_MS = (20.0, 0.0)  # reported, no target
STREAM_SERVICE_MS = 20.0
STREAM_CHUNKS = 8
STREAM_GAP_MS = 5.0

# Core layout under taskset (see the docstring).
UPSTREAM_CPU, GATEWAY_CPU, CLIENT_CPU = 1, 0, 0

# ---------------------------------------------------------------- the upstream (uvicorn --factory)


def make_upstream() -> Any:
    """A minimal OpenAI-compatible chat server; timings from P6_* environment variables."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    service_s = float(os.environ.get("P6_SERVICE_MS", "0")) / 1000
    chunks = int(os.environ.get("P6_CHUNKS", str(STREAM_CHUNKS)))
    gap_s = float(os.environ.get("P6_GAP_MS", str(STREAM_GAP_MS))) / 1000

    def chunk_event(model: str, index: int) -> bytes:
        delta = {"role": "assistant", "content": ""} if index == 0 else {"content": f"tok{index} "}
        event = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1764633600,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": "stop" if index == chunks - 1 else None,
                }
            ],
        }
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    async def events(model: str) -> AsyncIterator[bytes]:
        for index in range(chunks):
            if index:
                await asyncio.sleep(gap_s)
            yield chunk_event(model, index)
        yield b"data: [DONE]\n\n"

    async def chat_completions(request: Request) -> Response:
        payload = json.loads(await request.body())
        model = payload.get("model")
        if service_s:
            await asyncio.sleep(service_s)  # the model's time to answer (or to first token)
        if payload.get("stream"):
            return StreamingResponse(events(model), media_type="text/event-stream")
        return JSONResponse({**COMPLETION, "model": model})

    return Starlette(routes=[Route(PATH, chat_completions, methods=["POST"])])


# ---------------------------------------------------------------- processes


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without MODALGATE_* settings, so only the flags shape the gateway."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODALGATE_")}
    env.update(extra)
    return env


def start_upstream(service_ms: float, cpu: int | None) -> ServerProcess:
    port = free_port()
    command = uvicorn_command(f"{Path(__file__).stem}:make_upstream", HERE, port, cpu)
    env = _clean_env(P6_SERVICE_MS=f"{service_ms:g}")
    return ServerProcess(f"upstream ({service_ms:g} ms)", command, port, env)


def start_gateway(
    upstream: ServerProcess, cpu: int | None, *extra: str, name: str | None = None
) -> ServerProcess:
    """``modalgate serve`` in front of ``upstream``; ``extra`` flags go on its command line."""
    port = free_port()
    command = [
        *pin(cpu),
        sys.executable,
        "-m",
        "modalgate.gateway.cli",
        "serve",
        "--upstream",
        f"http://127.0.0.1:{upstream.port}",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        *extra,
    ]
    return ServerProcess(name or f"gateway -> {upstream.name}", command, port, _clean_env())


@contextlib.contextmanager
def stopping(processes: list[ServerProcess]) -> Iterator[list[ServerProcess]]:
    """Every process appended to the list is stopped on the way out, error or not."""
    try:
        yield processes
    finally:
        for process in reversed(processes):
            process.stop()


# ---------------------------------------------------------------- checks and load


@dataclass
class WrkRun:
    rate: float
    requests: int
    latency: str  # wrk's mean latency, as it prints it


def run_wrk(
    url: str,
    script: str,
    seconds: float,
    connections: int,
    cpu: int | None,
    timeout_s: float = 10.0,
) -> WrkRun:
    """One wrk run; raises on any non-2xx response or socket error."""
    command = [
        *pin(cpu),
        shutil.which("wrk") or "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{seconds:g}s",
        "--timeout",
        f"{timeout_s:g}s",  # a slow response is a slow response, not a socket error
        "-s",
        script,
        url,
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    total = re.search(r"(\d+) requests in", output)
    latency = re.search(r"Latency\s+(\S+)", output)
    if rate is None or total is None:
        raise RuntimeError(f"cannot read wrk's output:\n{output}")
    problems = re.findall(r"Non-2xx or 3xx responses: \d+|Socket errors: .*", output)
    if problems:
        raise RuntimeError(f"wrk against {url}: {'; '.join(problems)}\n{output}")
    return WrkRun(float(rate.group(1)), int(total.group(1)), latency.group(1) if latency else "?")


@dataclass
class Scenario:
    service_ms: float
    ratios: list[float]
    rows: list[tuple[object, ...]]
    cpu_us: dict[str, float]  # median CPU microseconds per request, per process and arm


def throughput(
    service_ms: float,
    upstream: ServerProcess,
    gateway: ServerProcess,
    script: str,
    rounds: int,
    seconds: float,
    warm_up: float,
    connections: int,
    wrk_cpu: int | None,
) -> Scenario:
    for url in (upstream.url, gateway.url):
        run_wrk(url, script, warm_up, connections, wrk_cpu)
    ratios: list[float] = []
    rows: list[tuple[object, ...]] = []
    cpu: dict[str, list[float]] = {"upstream direct": [], "upstream proxied": [], "gateway": []}
    for r in range(rounds):
        measured: dict[str, WrkRun] = {}
        # direct, proxied | proxied, direct | ...: the order flips every round.
        for arm in ("direct", "proxied") if r % 2 == 0 else ("proxied", "direct"):
            url = upstream.url if arm == "direct" else gateway.url
            before = (upstream.cpu_seconds(), gateway.cpu_seconds())
            measured[arm] = run = run_wrk(url, script, seconds, connections, wrk_cpu)
            n = max(run.requests, 1)
            cpu[f"upstream {arm}"].append((upstream.cpu_seconds() - before[0]) / n * 1e6)
            if arm == "proxied":
                cpu["gateway"].append((gateway.cpu_seconds() - before[1]) / n * 1e6)
        direct, proxied = measured["direct"], measured["proxied"]
        ratios.append(proxied.rate / direct.rate)
        rows.append((r + 1, direct.rate, proxied.rate, ratios[-1], direct.latency, proxied.latency))
    cpu_us = {name: statistics.median(values) for name, values in cpu.items()}
    return Scenario(service_ms, ratios, rows, cpu_us)


# ---------------------------------------------------------------- streamed latency


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def streamed_latency(
    upstream: ServerProcess, gateway: ServerProcess, requests: int
) -> dict[str, list[float]]:
    """Seconds to the first body bytes and to the end, per request, direct and proxied."""
    import httpx

    body = json.dumps({**REQUEST, "stream": True}, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    times: dict[str, list[float]] = {
        "direct first": [],
        "direct total": [],
        "proxied first": [],
        "proxied total": [],
    }
    with httpx.Client(trust_env=False, timeout=30) as client:

        def one(arm: str, url: str) -> None:
            start = time.perf_counter()
            first = None
            received = bytearray()
            with client.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{arm}: HTTP {response.status_code}")
                for chunk in response.iter_raw():
                    if chunk and first is None:
                        first = time.perf_counter() - start
                    received += chunk
            total = time.perf_counter() - start
            events = received.count(b"data: ")
            if events != STREAM_CHUNKS + 1 or not received.endswith(b"data: [DONE]\n\n"):
                raise RuntimeError(f"{arm}: unexpected stream ({events} events)")
            times[f"{arm} first"].append(first if first is not None else total)
            times[f"{arm} total"].append(total)

        arms = (("direct", upstream.url), ("proxied", gateway.url))
        for _ in range(5):  # warm-up: connections, caches
            for arm, url in arms:
                one(arm, url)
        for times_list in times.values():
            times_list.clear()
        for i in range(requests):
            for arm, url in arms if i % 2 == 0 else arms[::-1]:
                one(arm, url)
    return times


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~25 s)")
    parser.add_argument("--rounds", type=int, default=None, help="wrk rounds per scenario")
    parser.add_argument("--seconds", type=float, default=None, help="wrk duration per run")
    parser.add_argument("--connections", type=int, default=32, help="wrk -c, both arms")
    parser.add_argument("--requests", type=int, default=None, help="streamed requests per arm")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 6)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    warm_up = 1.0 if args.quick else 2.0
    requests = args.requests or (40 if args.quick else 300)

    print(f"== {NAME}")
    print(machine_line())
    if shutil.which("wrk") is None:
        print("wrk not found; cannot run")
        print(result_line(NAME, 0.0, f">= {TARGET}", False))
        return
    can_pin = not args.no_pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    upstream_cpu, gateway_cpu, wrk_cpu = (UPSTREAM_CPU, GATEWAY_CPU, 0) if can_pin else (None,) * 3
    if can_pin:
        os.sched_setaffinity(0, {CLIENT_CPU})  # this script: the streamed-latency client
        print("pinning: upstream on core 1; gateway, wrk and the latency client on core 0")
    else:
        print("pinning: none (taskset missing, --no-pin, or a single core)")
    import httpx
    import uvicorn

    print(
        f"uvicorn {uvicorn.__version__}, httpx {httpx.__version__}; upstream and gateway 1 worker "
        f"each, no access log, log level warning; wrk -t1 -c{args.connections} -d{seconds:g}s, "
        f"{rounds} round(s) per scenario after a {warm_up:g} s warm-up of each arm"
    )
    print(f"request: POST {PATH}, {len(REQUEST_BODY)} bytes, text-only, model kimi-k3")

    scenarios: list[Scenario] = []
    latency: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, stopping([]) as processes:
        script = str(Path(tmp) / "post.lua")
        Path(script).write_text(WRK_LUA.format(body=REQUEST_BODY))
        pairs: list[tuple[float, ServerProcess, ServerProcess]] = []
        for service_ms in (HEADLINE_SERVICE_MS, *STRESS_SERVICE_MS):
            upstream = start_upstream(service_ms, upstream_cpu)
            processes.append(upstream)
            gateway = start_gateway(upstream, gateway_cpu)
            processes.append(gateway)
            pairs.append((service_ms, upstream, gateway))
        for _, upstream, gateway in pairs:
            upstream.wait_ready()
            gateway.wait_ready()
            check_gate_in_path(upstream, gateway, REQUEST_BODY.encode())
        for service_ms, upstream, gateway in pairs:
            scenarios.append(
                throughput(
                    service_ms,
                    upstream,
                    gateway,
                    script,
                    rounds,
                    seconds,
                    warm_up,
                    args.connections,
                    wrk_cpu,
                )
            )
        _, upstream, gateway = next(p for p in pairs if p[0] == STREAM_SERVICE_MS)
        latency = streamed_latency(upstream, gateway, requests)

    headers = ("round", "direct req/s", "proxied req/s", "ratio", "direct lat", "proxied lat")
    for scenario, label in zip(
        scenarios,
        ("(a) headline", "(b) stress, no target", "(c) worst case, no target"),
        strict=True,
    ):
        print(f"\nscenario {label}: upstream service time {scenario.service_ms:g} ms")
        print(table(headers, scenario.rows))
        cpu = scenario.cpu_us
        print(
            f"median ratio {statistics.median(scenario.ratios):.3f} "
            f"(spread {spread(scenario.ratios)})"
        )
        print(
            f"CPU per request (median over rounds): upstream {cpu['upstream direct']:.0f} us "
            f"direct, {cpu['upstream proxied']:.0f} us proxied; gateway {cpu['gateway']:.0f} us"
        )

    print(
        f"\nstreamed latency: {requests} requests per arm, sequential, alternating; upstream "
        f"{STREAM_SERVICE_MS:g} ms to first chunk, then {STREAM_CHUNKS} chunks "
        f"{STREAM_GAP_MS:g} ms apart"
    )
    rows = []
    for what in ("first", "total"):
        direct, proxied = latency[f"direct {what}"], latency[f"proxied {what}"]
        for q in (50, 99):
            d, p = percentile(direct, q), percentile(proxied, q)
            rows.append(
                (
                    f"{what} chunk" if what == "first" else "total",
                    f"p{q}",
                    d * 1e3,
                    p * 1e3,
                    (p - d) * 1e3,
                )
            )
    print(table(("measure", "pct", "direct ms", "proxied ms", "added ms"), rows))

    headline = scenarios[0]
    ratio = statistics.median(headline.ratios)
    others = ", ".join(
        f"{s.service_ms:g} ms {statistics.median(s.ratios):.2f} ({spread(s.ratios)})"
        for s in scenarios[1:]
    )
    print(
        f"\nthroughput ratio at -c{args.connections}: (a) {HEADLINE_SERVICE_MS:g} ms service "
        f"{ratio:.2f} ({spread(headline.ratios)}); without target: {others}"
    )
    print(result_line(NAME, ratio, f">= {TARGET}", ratio >= TARGET))


if __name__ == "__main__":
    main()
