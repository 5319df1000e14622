"""P1: HTTP throughput of a minimal chat app, bare vs wrapped in ``ModalGate(app, policy=None)``.

Two uvicorn servers (one worker each, ``--no-access-log``, log level warning)
serve the same app on 127.0.0.1: one bare, one behind the gate with the
built-in policy. Two such pairs, each measured on its own: a Starlette app
(target >= 0.90), and a raw ASGI app doing the same work without a framework
(target >= 0.85: the cheaper the app, the larger the gate's share). wrk POSTs
a ~300-byte text-only chat request (model kimi-k3, a system and a user
message) at each server of a pair in turn: bare, gated, bare, gated, ... (the
order flips every round) so both see the same machine weather. The app reads
the request, takes its ``model`` and answers a small, fixed chat completion, as
any chat endpoint must at the very least.

With taskset available, each server runs on core 1 and wrk on core 0, so the
load generator does not steal the server's CPU.

Ratio = gated req/s / bare req/s (per round). One RESULT line per app.

Usage: .venv/bin/python benchmarks/p1_middleware_overhead.py [--quick] [--app starlette|raw|both]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import machine_line, result_line, spread, table
from _servers import (
    PATH,
    ServerProcess,
    check_gate_in_path,
    free_port,
    pin,
    scope_for,
    uvicorn_command,
)

NAME = "p1_middleware_overhead"
TARGET = 0.90
RAW_NAME = "p1_middleware_overhead_raw"
RAW_TARGET = 0.85
HERE = Path(__file__).resolve().parent

REQUEST = {
    "model": "kimi-k3",
    "messages": [
        {
            "role": "system",
            "content": "You are a concise assistant. Answer in one short paragraph.",
        },
        {
            "role": "user",
            "content": "What is the difference between a process and a thread, "
            "and when should I prefer one over the other in a Python web server?",
        },
    ],
    "max_tokens": 128,
    "temperature": 0.7,
}
REQUEST_BODY = json.dumps(REQUEST, separators=(",", ":"))

COMPLETION = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1764633600,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "A process has its own memory; ..."},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 52, "completion_tokens": 9, "total_tokens": 61},
}

# ---------------------------------------------------------------- the app (uvicorn --factory)


def make_bare():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat_completions(request: Request) -> JSONResponse:
        payload = json.loads(await request.body())
        return JSONResponse({**COMPLETION, "model": payload.get("model")})

    return Starlette(routes=[Route(PATH, chat_completions, methods=["POST"])])


def make_gated():
    from modalgate import ModalGate

    return ModalGate(make_bare(), policy=None)


def make_raw():
    """The same endpoint as plain ASGI: read the body, echo its model, answer."""
    answers = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != PATH or scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        model = json.loads(b"".join(chunks)).get("model")
        body = answers.get(model)
        if body is None:
            body = answers[model] = json.dumps({**COMPLETION, "model": model}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def make_raw_gated():
    from modalgate import ModalGate

    return ModalGate(make_raw(), policy=None)


# ---------------------------------------------------------------- orchestration

WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
"""


class Server(ServerProcess):
    def __init__(self, name: str, factory: str, cpu: int | None) -> None:
        port = free_port()
        command = uvicorn_command(f"{Path(__file__).stem}:{factory}", HERE, port, cpu)
        super().__init__(name, command, port)


def run_wrk(
    url: str, script: str, seconds: float, threads: int, connections: int, cpu: int | None
) -> tuple[float, int, int]:
    """(requests/s, requests, non-2xx responses + socket errors)."""
    command = [
        *pin(cpu),
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{seconds:g}s",
        "-s",
        script,
        url,
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))
    total = int(re.search(r"(\d+) requests in", output).group(1))
    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", output))
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    if errors:
        bad += sum(int(n) for n in errors.groups())
    return rate, total, bad


def instructions_per_request(factory: str, script: str, seconds: float) -> int | str:
    """Instructions per request of one uvicorn server under load, counted by callgrind
    (deterministic, so a gated/bare ratio holds on a busy machine), or why not counted.

    The server runs under valgrind with counting off; after a warm-up, counting is
    switched on for one wrk run (no pinning: valgrind is ~50x slower) and the total
    is divided by the requests wrk saw answered.
    """
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return "valgrind (callgrind_control) not found"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        port = free_port()
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        command += [f"--callgrind-out-file={out}", f"--log-file={Path(tmp) / 'valgrind.log'}"]
        command += uvicorn_command(f"{Path(__file__).stem}:{factory}", HERE, port, None)
        server = ServerProcess(factory, command, port, {**os.environ, "PYTHONHASHSEED": "0"})
        try:
            server.wait_ready(timeout=120)
            run_wrk(server.url, script, 5, 1, 16, None)  # warm-up, not counted
            pid = str(server.process.pid)
            subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
            _rate, answered, bad = run_wrk(server.url, script, seconds, 1, 16, None)
            subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
        finally:
            server.stop()
        dumps = sorted(Path(tmp).glob("callgrind.out.*"))
        totals = [re.search(r"^totals: (\d+)", d.read_text(), re.M) for d in dumps]
        counted = sum(int(t.group(1)) for t in totals if t)
        if not counted or not answered or bad:
            return f"nothing counted ({answered} requests, {bad} bad)"
        return counted // answered


def in_process_costs(repeats: int) -> dict[str, float]:
    """Microseconds per request without HTTP (best of ``repeats``, interleaved).

    bare / gated: the benchmark app, called as ASGI. validate: ``validate_body``
    alone. gate_only: ``ModalGate`` around an app that only reads its body, so
    header checks + body read + validation + replay, without the app's own work.
    """
    import asyncio

    from modalgate import ModalGate
    from modalgate.policy import RuleMatcher, load_policy
    from modalgate.validators import validate_body

    body = REQUEST_BODY.encode()
    scope = scope_for(body)

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        pass

    async def reads_body(scope, receive, send) -> None:
        await receive()

    async def per_request(app, n: int = 1000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await app(dict(scope), receive, send)
        return (time.perf_counter() - start) / n * 1e6

    def per_call(fn, n: int = 1000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    async def measure() -> dict[str, list[float]]:
        bare, gated = make_bare(), make_gated()
        gate_only = ModalGate(reads_body, policy=None)
        matcher = RuleMatcher(load_policy(), None)
        times: dict[str, list[float]] = {k: [] for k in ("bare", "gated", "validate", "gate_only")}
        for _ in range(repeats):
            times["bare"].append(await per_request(bare))
            times["gated"].append(await per_request(gated))
            times["gate_only"].append(await per_request(gate_only) - await per_request(reads_body))
            times["validate"].append(per_call(lambda: validate_body(body, matcher)))
        return times

    # best of repeats: the least-disturbed estimate of each cost on a noisy machine
    return {name: min(values) for name, values in asyncio.run(measure()).items()}


def measure_pair(
    bare_factory: str,
    gated_factory: str,
    script: str,
    rounds: int,
    seconds: float,
    args: argparse.Namespace,
    server_cpu: int | None,
    wrk_cpu: int | None,
) -> tuple[list[float], list[float], float, int]:
    """Per-round req/s ratios and per-CPU-second ratios of one bare/gated pair (a table
    is printed), the bare server's median req/s, and the bad responses seen."""
    bare = Server("bare", bare_factory, server_cpu)
    gated = Server("gated", gated_factory, server_cpu)
    try:
        bare.wait_ready()
        gated.wait_ready()
        check_gate_in_path(bare, gated, REQUEST_BODY.encode())
        warm_up = 1 if args.quick else 3  # seconds: imports, caches, allocator settling
        for server in (bare, gated):
            run_wrk(server.url, script, warm_up, args.threads, args.connections, wrk_cpu)
        rows = []
        ratios = []
        cpu_ratios = []
        problems = 0
        for r in range(rounds):
            measured = {}
            # bare, gated | gated, bare | ...: the order flips every round so drift cancels.
            for server in (bare, gated) if r % 2 == 0 else (gated, bare):
                cpu_before = server.cpu_seconds()
                rate, n, bad = run_wrk(
                    server.url, script, seconds, args.threads, args.connections, wrk_cpu
                )
                per_cpu = n / max(server.cpu_seconds() - cpu_before, 1e-9)
                measured[server.name] = (rate, per_cpu, bad)
            (rate_bare, cpu_bare, bad_bare) = measured["bare"]
            (rate_gated, cpu_gated, bad_gated) = measured["gated"]
            problems += bad_bare + bad_gated
            ratios.append(rate_gated / rate_bare)
            cpu_ratios.append(cpu_gated / cpu_bare)
            rows.append(
                (r + 1, rate_bare, rate_gated, ratios[-1], cpu_bare, cpu_gated, cpu_ratios[-1])
            )
    finally:
        bare.stop()
        gated.stop()
    headers = ("round", "bare req/s", "gated req/s", "ratio")
    headers += ("bare req/cpu-s", "gated req/cpu-s", "cpu ratio")
    print(table(headers, rows))
    print(f"median ratio {statistics.median(ratios):.3f} (spread {spread(ratios)})")
    print(
        f"cross-check, requests per CPU-second of the server process (less sensitive to other load "
        f"on the machine): median ratio {statistics.median(cpu_ratios):.3f} "
        f"(spread {spread(cpu_ratios)})"
    )
    return ratios, cpu_ratios, statistics.median(row[1] for row in rows), problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~10 s)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None, help="wrk duration per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    parser.add_argument("--app", choices=("starlette", "raw", "both"), default="both")
    parser.add_argument(
        "--instructions", action="store_true", help="also count under callgrind (~2 min a pair)"
    )
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 10)
    seconds = args.seconds or (2.0 if args.quick else 3.0)

    if shutil.which("wrk") is None:
        print("wrk not found; cannot run")
        print(result_line(NAME, 0.0, f">={TARGET}", False))
        return
    can_pin = not args.no_pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    server_cpu, wrk_cpu = (1, 0) if can_pin else (None, None)

    print(f"== {NAME}")
    print(machine_line())
    if can_pin:
        print("pinning: servers on core 1, wrk on core 0 (taskset)")
    else:
        print("pinning: none (taskset missing, --no-pin, or a single core)")
    import uvicorn

    print(
        f"uvicorn {uvicorn.__version__}, 1 worker each, --no-access-log, log level warning; "
        f"wrk -t{args.threads} -c{args.connections} -d{seconds:g}s, {rounds} round(s)"
    )
    print(f"request: POST {PATH}, {len(REQUEST_BODY)} bytes, text-only, model kimi-k3")

    pairs = {
        "starlette": ("make_bare", "make_gated", NAME, TARGET),
        "raw": ("make_raw", "make_raw_gated", RAW_NAME, RAW_TARGET),
    }
    chosen = list(pairs) if args.app == "both" else [args.app]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp) / "post.lua")
        Path(script).write_text(WRK_LUA.format(body=REQUEST_BODY))
        for app in chosen:
            bare_factory, gated_factory, name, target = pairs[app]
            print(f"\n-- {app} app: {bare_factory} vs {gated_factory}")
            measured = measure_pair(
                bare_factory, gated_factory, script, rounds, seconds, args, server_cpu, wrk_cpu
            )
            results.append((app, name, target, measured))
            if args.instructions:
                counts = [
                    instructions_per_request(f, script, 10) for f in (bare_factory, gated_factory)
                ]
                if all(isinstance(n, int) for n in counts):
                    bare_n, gated_n = counts
                    print(
                        f"instructions per request under uvicorn (callgrind): bare {bare_n:,}, "
                        f"gated {gated_n:,}; the gate {gated_n - bare_n:,}; bare / gated "
                        f"{bare_n / gated_n:.3f} (P1's ratio, were time spent as instructions)"
                    )
                else:
                    print(f"instructions not counted: {counts}")

    costs = in_process_costs(3 if args.quick else 10)
    overhead = costs["gated"] - costs["bare"]
    print(
        f"\nin-process ASGI, no HTTP (us/request, best of repeats): Starlette "
        f"bare app {costs['bare']:.1f}, gated {costs['gated']:.1f}, gate overhead {overhead:.1f}"
    )
    print(
        f"  the gate around an app that only reads the body: {costs['gate_only']:.1f}, "
        f"of which validate_body {costs['validate']:.1f} (the rest: header checks, body read, "
        "replay, per-request objects; benchmarks/p9_gate_cost.py splits it further)"
    )
    for app, _name, _target, (_ratios, _cpu, bare_rate, problems) in results:
        http_us = 1e6 / bare_rate
        print(
            f"  {app}: a bare request over HTTP costs ~{http_us:.0f} us here (the uvicorn server "
            f"dominates): expected ratio ~{http_us / (http_us + costs['gate_only']):.2f}"
        )
        if problems:
            print(f"WARNING: {problems} non-2xx responses or socket errors during the {app} runs")
    for _app, name, target, (ratios, _cpu, _rate, problems) in results:
        ratio = statistics.median(ratios)
        print(result_line(name, ratio, f">={target}", ratio >= target and not problems))


if __name__ == "__main__":
    main()
