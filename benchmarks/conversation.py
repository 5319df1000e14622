"""What a conversation costs the gate, turn by turn (issue 43: each image judged once).

A chat client resends the whole conversation every turn: here ten turns, each carrying
the same four photos (two noise JPEGs and two noise PNGs, ~1 MB each, so a ~5.4 MB body)
plus the turns before it as text. ``--conversations`` such chats (each its own photos,
so every turn 1 is new) are sent turn by turn: all turn 1s, then all turn 2s, and so on.

Two places, each with the verdict cache on and off (``verdict_cache.enabled``):

- **middleware**: ``ModalGate`` around an app that drains the body, driven in-process
  with 64 KB body messages as a server hands them; gate CPU per request is the
  process's CPU time (every thread) less the same requests through the bare app.
- **serve**: ``modalgate serve --upstream`` in front of P7's raw upstream, asked over
  HTTP/1.1; its CPU per request read from /proc (every thread's schedstat, in ns).
  The gate's share is that less the same body's CPU on a path the gate does not judge
  (``/v1/unjudged``, proxied untouched): what receiving and forwarding 5 MB costs.

RESULT lines: the largest of turns 2-10's gate CPU over turn 1's, cache on, for each
place (goal <= 0.25).

Usage: .venv/bin/python benchmarks/conversation.py [--conversations N] [--turns T]
       [--quick] [--no-serve]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import orjson
from _common import data_url, machine_line, noise_jpeg, result_line, table
from _servers import ServerProcess, free_port, uvicorn_command
from PIL import Image

from modalgate import ModalGate
from modalgate.policy import parse_policy

NAME = "conversation"
TARGET = 0.25  # each later turn's gate CPU over turn 1's
HERE = Path(__file__).resolve().parent
CHUNK = 64 * 1024
OFF_POLICY = "extends: builtin\nverdict_cache: {enabled: false}\n"


def noise_png(side: int, seed: int) -> bytes:
    image = Image.frombytes("RGB", (side, side), random.Random(seed).randbytes(side * side * 3))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def photos(seed: int) -> list[str]:
    """Four ~1 MB photos as data URLs, new for every ``seed``."""
    jpegs = [noise_jpeg(1024, 90, seed * 4 + i) for i in range(2)]
    pngs = [noise_png(590, seed * 4 + 2 + i) for i in range(2)]
    return [data_url(j) for j in jpegs] + [data_url(p, "image/png") for p in pngs]


def turn_body(urls: list[str], turn: int) -> bytes:
    """Turn ``turn`` (1-based) of a chat about these photos: every earlier turn resent."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these four photos."}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful visual inspector."},
        {"role": "user", "content": parts},
    ]
    for earlier in range(1, turn):
        messages.append({"role": "assistant", "content": f"Answer {earlier}: " + "word " * 60})
        messages.append({"role": "user", "content": f"Follow-up question {earlier}?"})
    return orjson.dumps({"model": "kimi-k3", "messages": messages, "max_tokens": 64})


# ---------------------------------------------------------------- middleware, in-process


async def drain(scope: dict[str, Any], receive: Any, send: Any) -> None:
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def scope_of(path: str, length: int) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }


async def call(app: Any, body: bytes) -> int:
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
    status = 0

    async def receive() -> dict[str, Any]:
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope_of("/v1/chat/completions", len(body)), receive, send)
    return status


def middleware_turns(chats: list[list[str]], turns: int, warm: list[str]) -> dict[str, list[float]]:
    """Gate CPU ms per request, per turn: cache on, cache off; each arm warmed first on
    two turns of a chat of its own (threads started, code paths taken once)."""
    arms = {
        "on": ModalGate(drain, policy=None, engine=None),
        "off": ModalGate(drain, policy=parse_policy(OFF_POLICY, fmt="yaml"), engine=None),
    }
    results: dict[str, list[float]] = {name: [] for name in arms}

    async def run() -> None:
        for gate in arms.values():
            for turn in (1, 2):
                assert await call(gate, turn_body(warm, turn)) == 200
        for turn in range(1, turns + 1):
            bodies = [turn_body(urls, turn) for urls in chats]
            started = time.process_time()
            for body in bodies:
                await call(drain, body)
            bare = time.process_time() - started
            for name, gate in arms.items():
                started = time.process_time()
                for body in bodies:
                    assert await call(gate, body) == 200
                spent = time.process_time() - started - bare
                results[name].append(spent * 1000 / len(bodies))

    asyncio.run(run())
    return results


# ---------------------------------------------------------------- serve, over HTTP


def process_cpu_ns(pid: int) -> int:
    """Every thread's CPU time (``schedstat``: nanoseconds, not 10 ms ticks)."""
    total = 0
    for task in os.scandir(f"/proc/{pid}/task"):
        with suppress(OSError, ValueError):  # a thread that ended meanwhile
            total += int(Path(task.path, "schedstat").read_text().split()[0])
    return total


@contextmanager
def servers(tmp: Path) -> Iterator[tuple[ServerProcess, dict[str, ServerProcess]]]:
    started: list[ServerProcess] = []
    try:
        port = free_port()
        command = uvicorn_command("p7_proxies:make_upstream", HERE, port, None)
        upstream = ServerProcess("upstream", command, port)
        started.append(upstream)
        upstream.wait_ready()
        off = tmp / "off.yaml"
        off.write_text(OFF_POLICY, "utf-8")
        gates = {}
        for name, policy in (("on", []), ("off", ["--policy", str(off)])):
            gate_port = free_port()
            command = [sys.executable, "-m", "modalgate.gateway.cli", "serve", *policy]
            command += ["--upstream", f"http://127.0.0.1:{port}", "--port", str(gate_port)]
            command += ["--log-level", "warning", "--no-access-log"]
            env = {k: v for k, v in os.environ.items() if not k.startswith("MODALGATE_")}
            gates[name] = ServerProcess(f"serve ({name})", command, gate_port, env)
            started.append(gates[name])
            gates[name].wait_ready(60)
        yield upstream, gates
    finally:
        for process in started:
            process.stop()


def serve_turns(chats: list[list[str]], turns: int, warm: list[str]) -> dict[str, list[float]]:
    """serve's CPU ms per request per turn (cache on, off), and its proxying floor; each
    server warmed first on two turns of a chat of its own."""
    results: dict[str, list[float]] = {"on": [], "off": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp, servers(Path(tmp)) as (_, gates):
        clients = {
            name: httpx.Client(base_url=f"http://127.0.0.1:{gate.port}", timeout=60)
            for name, gate in gates.items()
        }
        headers = {"content-type": "application/json"}

        def spent(name: str, path: str, bodies: list[bytes], want: int) -> float:
            pid = gates[name].process.pid
            before = process_cpu_ns(pid)
            for body in bodies:
                status = clients[name].post(path, content=body, headers=headers).status_code
                assert status == want, (name, path, status)
            return (process_cpu_ns(pid) - before) / 1e6 / len(bodies)

        for name in ("on", "off"):
            spent(name, "/v1/unjudged", [turn_body(warm, 1)], 404)
            spent(name, "/v1/chat/completions", [turn_body(warm, t) for t in (1, 2)], 200)
        for turn in range(1, turns + 1):
            bodies = [turn_body(urls, turn) for urls in chats]
            results["floor"].append(spent("off", "/v1/unjudged", bodies, 404))
            for name in ("on", "off"):
                results[name].append(spent(name, "/v1/chat/completions", bodies, 200))
        for client in clients.values():
            client.close()
    return results


# ---------------------------------------------------------------- report


def report(place: str, on: list[float], off: list[float], floor: list[float] | None) -> float:
    gate_on = [v - (floor[i] if floor else 0.0) for i, v in enumerate(on)]
    gate_off = [v - (floor[i] if floor else 0.0) for i, v in enumerate(off)]
    rows = []
    for i in range(len(on)):
        row: list[object] = [i + 1]
        if floor:
            row += [f"{on[i]:.2f}", f"{off[i]:.2f}", f"{floor[i]:.2f}"]
        row += [
            f"{gate_on[i]:.2f}",
            f"{gate_off[i]:.2f}",
            f"{gate_on[i] / gate_on[0]:.3f}",
        ]
        rows.append(row)
    headers = ["turn"]
    if floor:
        headers += ["serve on", "serve off", "unjudged"]
    headers += ["gate on", "gate off", "on ÷ turn 1"]
    print(f"\n{place}: CPU ms per request")
    print(table(headers, rows))
    worst = max(gate_on[1:]) / gate_on[0]
    print(result_line(f"{NAME}_{place}", worst, f"<= {TARGET:g}", worst <= TARGET))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 conversations")
    parser.add_argument("--no-serve", action="store_true", help="the middleware only")
    args = parser.parse_args()
    count = 3 if args.quick else args.conversations
    print(machine_line())
    made = time.perf_counter()
    chats = [photos(seed) for seed in range(count)]
    warm = photos(count)
    size = len(turn_body(chats[0], 1))
    print(
        f"{count} conversations x {args.turns} turns; 4 photos each (2 JPEG, 2 PNG, "
        f"{sum(len(u) for u in chats[0]) * 3 // 4 // 4 / 1e6:.2f} MB each on average), "
        f"turn 1 body {size / 1e6:.2f} MB (made in {time.perf_counter() - made:.1f} s)"
    )
    runs: list[tuple[str, Callable[[], None]]] = [
        ("middleware", lambda: _middleware(chats, args.turns, warm))
    ]
    if not args.no_serve:
        runs.append(("serve", lambda: _serve(chats, args.turns, warm)))
    for _, run in runs:
        run()
    return 0


def _middleware(chats: list[list[str]], turns: int, warm: list[str]) -> None:
    results = middleware_turns(chats, turns, warm)
    report("middleware", results["on"], results["off"], None)


def _serve(chats: list[list[str]], turns: int, warm: list[str]) -> None:
    results = serve_turns(chats, turns, warm)
    report("serve", results["on"], results["off"], results["floor"])


if __name__ == "__main__":
    sys.exit(main())
