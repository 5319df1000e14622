"""P9: the gate's own cost in process: ``ModalGate`` around a raw ASGI app vs the raw app alone.

No HTTP and no server: both apps are called as ASGI coroutines on one event
loop with P1's 308-byte text-only chat request (model kimi-k3), so what is left
is the gate itself: path normalisation, the header checks, reading the body,
``validate_body`` (the JSON parse with duplicate keys refused, the walk), the
verdict, and the replay to the app. The raw app reads the body and sends a
small fixed answer, as any ASGI endpoint must at the least.

Rounds interleave the two arms (raw, gated | gated, raw | ...), each arm
serving ``--requests`` requests per round; the per-round gate cost is gated
minus raw microseconds per request. Also timed each round: ``validate_body``
alone and ``parse_json_body`` alone, so the cost splits into the JSON parse,
the rest of validation, and the middleware around them. Before timing, the
gated app must pass P1's body to the app and refuse a video part with 400
``unsupported_modality``.

``--instructions`` also counts instructions per request under valgrind's
callgrind (deterministic: immune to the other work on a shared machine), the
helper that switches counting on around the timed loop compiled on the fly
with the system C compiler; skipped with a line saying why where valgrind,
its headers or a compiler are missing.

Target (issue #16): the gate costs <= 5 us per text-only request.

Usage: .venv/bin/python benchmarks/p9_gate_cost.py [--quick] [--rounds N] [--requests N]
       [--instructions]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import machine_line, result_line, spread, table
from _servers import PATH, VIDEO_REQUEST, scope_for
from p1_middleware_overhead import REQUEST_BODY

NAME = "p9_gate_cost"
TARGET_US = 5.0
HERE = Path(__file__).resolve().parent
BODY = REQUEST_BODY.encode()
ANSWER = b'{"id":"chatcmpl-bench","object":"chat.completion","choices":[]}'
START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))],
}
FINISH = {"type": "http.response.body", "body": ANSWER, "more_body": False}

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def raw_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers a fixed chat completion."""
    while (await receive()).get("more_body", False):
        pass
    await send(START)
    await send(FINISH)


def gated_app() -> App:
    from modalgate import ModalGate

    return ModalGate(raw_app, policy=None)


async def serve(app: App, body: bytes, requests: int) -> list[dict[str, Any]]:
    """Call ``app`` ``requests`` times with ``body``; the messages of the last one."""
    template = scope_for(body)
    request = {"type": "http.request", "body": body, "more_body": False}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        pass

    for _ in range(requests - 1):
        scope = dict(template)
        scope["state"] = {}
        await app(scope, receive, send)

    async def keep(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(dict(template, state={}), receive, keep)
    return sent


def check_gate_in_path(gated: App) -> None:
    answered = asyncio.run(serve(gated, BODY, 1))
    assert answered[0]["status"] == 200 and answered[1]["body"] == ANSWER, answered
    refused = asyncio.run(serve(gated, json.dumps(VIDEO_REQUEST).encode(), 1))
    error = json.loads(refused[1]["body"])["error"]
    assert refused[0]["status"] == 400 and error["code"] == "unsupported_modality", refused


def per_request_us(app: App, requests: int) -> float:
    async def run() -> float:
        start = time.perf_counter()
        await serve(app, BODY, requests)
        return (time.perf_counter() - start) / requests * 1e6

    return asyncio.run(run())


def per_call_us(function: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e6


# ---------------------------------------------------------------- instruction counts

_COUNTER_C = """
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void count_stop(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def count_instructions(arm: str, requests: int) -> int | str:
    """Instructions per request of one arm under callgrind, or why not counted."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if shutil.which("valgrind") is None or compiler is None:
        return "valgrind or a C compiler not found"
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        return "valgrind's headers (callgrind.h) not found"
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp, "counter.c"), Path(tmp, "counter.so")
        source.write_text(_COUNTER_C)
        subprocess.run([compiler, "-shared", "-fPIC", "-o", library, source], check=True)
        out = Path(tmp, "callgrind.out")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        command += [f"--callgrind-out-file={out}", sys.executable, __file__]
        command += ["--count-child", arm, str(requests), str(library)]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        dumps = sorted(Path(tmp).glob("callgrind.out.*"))
        if not dumps:
            return "callgrind wrote no counts"
        totals = re.search(r"^totals: (\d+)", dumps[0].read_text(), re.M)
        return int(totals.group(1)) // requests if totals else "no totals in callgrind's output"


def count_child(arm: str, requests: int, library: str) -> None:
    """Runs under callgrind: warm up, then count only the timed loop."""
    app = gated_app() if arm == "gated" else raw_app
    counter = ctypes.CDLL(library)

    async def run() -> None:
        await serve(app, BODY, 300)
        counter.count_start()
        await serve(app, BODY, requests)
        counter.count_stop()

    asyncio.run(run())


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~5 s)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="per arm and round")
    parser.add_argument("--instructions", action="store_true", help="count under callgrind too")
    parser.add_argument("--count-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        arm, requests, library = args.count_child
        count_child(arm, int(requests), library)
        return
    rounds = args.rounds or (3 if args.quick else 15)
    requests = args.requests or (5_000 if args.quick else 20_000)

    from modalgate.policy import RuleMatcher, load_policy
    from modalgate.validators import validate_body
    from modalgate.validators.json_body import parse_json_body

    print(f"== {NAME}")
    print(machine_line())
    print(
        f"request: POST {PATH}, {len(BODY)} bytes, text-only, model kimi-k3; "
        f"{rounds} round(s) x {requests} requests per arm, in process (no HTTP)"
    )
    gated = gated_app()
    check_gate_in_path(gated)
    matcher = RuleMatcher(load_policy(), None)
    per_request_us(raw_app, requests // 10)  # warm-up: allocator, caches
    per_request_us(gated, requests // 10)

    rows = []
    costs: list[float] = []
    ratios: list[float] = []
    validates: list[float] = []
    parses: list[float] = []
    for r in range(rounds):
        arms = (("raw", raw_app), ("gated", gated))
        measured = {
            name: per_request_us(app, requests) for name, app in (arms if r % 2 else arms[::-1])
        }
        validate = per_call_us(lambda: validate_body(BODY, matcher), requests)
        parse = per_call_us(lambda: parse_json_body(BODY), requests)
        costs.append(measured["gated"] - measured["raw"])
        ratios.append(measured["gated"] / measured["raw"])
        validates.append(validate)
        parses.append(parse)
        rows.append((r + 1, measured["raw"], measured["gated"], costs[-1], ratios[-1], validate))
    print(table(("round", "raw us", "gated us", "gate us", "ratio", "validate_body us"), rows))
    cost = statistics.median(costs)
    validate, parse = statistics.median(validates), statistics.median(parses)
    print(
        f"gate cost per request: median {cost:.2f} us (spread {spread(costs)}; the least "
        f"disturbed round {min(costs):.2f}); "
        f"gated / raw {statistics.median(ratios):.2f} (spread {spread(ratios)})"
    )
    print(
        f"of which validate_body {validate:.2f} us (parse_json_body {parse:.2f}, the walk and "
        f"verdict {validate - parse:.2f}); the middleware around it {cost - validate:.2f} us"
    )
    if args.instructions:
        counted = {arm: count_instructions(arm, 2_000) for arm in ("raw", "gated")}
        if all(isinstance(n, int) for n in counted.values()):
            raw_n, gated_n = counted["raw"], counted["gated"]
            print(
                f"instructions per request (callgrind, 2,000 requests): raw {raw_n:,}, "
                f"gated {gated_n:,}, the gate {gated_n - raw_n:,}"  # type: ignore[operator]
            )
        else:
            why = next(n for n in counted.values() if isinstance(n, str))
            print(f"instructions not counted: {why}")
    target = f"gate<={TARGET_US:g}us(got:{cost:.1f}us)"
    print(result_line(NAME, statistics.median(ratios), target, cost <= TARGET_US))


if __name__ == "__main__":
    main()
