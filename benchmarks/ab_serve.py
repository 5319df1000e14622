"""A/B: ``modalgate serve`` from another revision against the working tree, side by side.

Quick P7 rounds drift by ~10% on this shared machine, more than most single changes
are worth; two gateways measured in turn within one run do not. Both run in front
of one P7 upstream (a raw ASGI app that answers at once), pinned as P7 pins them:
the upstream alone on core 1, the gateway under test and wrk on core 0. The base
revision's ``modalgate/`` is exported with ``git archive`` to a temporary directory
and put first on that gateway's ``PYTHONPATH``; everything else (dependencies, this
script, the upstream) is shared. Rounds run A then B, then B then A, and so on;
each arm's figure is its median CPU per request (the gateway's process tree, from
/proc) over the rounds.

The ratio printed is B ÷ A (the working tree over the base): below 1, the change
saves CPU. A RESULT line is printed for ``run_all.py``-style collection, with no
target (a change has no fixed figure to reach).

Usage: .venv/bin/python benchmarks/ab_serve.py [--base REV] [--body text|image|both]
       [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine_line, spread, table
from _peers import API_KEY, tree_cpu_seconds
from _servers import ServerProcess, free_port, pin, uvicorn_command
from p1_middleware_overhead import REQUEST_BODY
from p6_proxy_overhead import _clean_env, run_wrk, stopping
from p7_proxies import UPSTREAM_KEEP_ALIVE_S, WRK_LUA, _started, image_body

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
UPSTREAM_CPU, GATEWAY_CPU, CLIENT_CPU = 1, 0, 0
CONNECTIONS = 16


def export_revision(revision: str, into: Path) -> None:
    """``modalgate/`` as it is at ``revision``, under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "modalgate"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def environment(tree: Path | None) -> dict[str, str]:
    """The gateway's environment: ``tree`` first on the path (None: the working tree, as
    installed). PYTHONSAFEPATH: ``-m`` would otherwise put the current directory (the
    repository root, when run from there) before PYTHONPATH, and both arms would run
    the working tree."""
    return _clean_env(PYTHONSAFEPATH="1", **({"PYTHONPATH": str(tree)} if tree else {}))


def imported_from(tree: Path | None) -> str:
    """Where the gateway's ``modalgate`` comes from, as its own interpreter sees it."""
    return subprocess.run(
        [sys.executable, "-c", "import modalgate; print(modalgate.__file__)"],
        env=environment(tree),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def gateway(tree: Path | None, upstream: int, cpu: int | None) -> ServerProcess:
    """``modalgate serve`` importing the package from ``tree`` (None: the working tree)."""
    port = free_port()
    env = environment(tree)
    command = [*pin(cpu), sys.executable, "-m", "modalgate.gateway.cli", "serve"]
    command += ["--upstream", f"http://127.0.0.1:{upstream}", "--port", str(port)]
    command += ["--log-level", "warning", "--no-access-log"]
    return ServerProcess("modalgate serve", command, port, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the revision for arm A (default HEAD)")
    parser.add_argument("--body", choices=("text", "image", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    pinned = (os.cpu_count() or 1) >= 2 and shutil.which("taskset")
    up_cpu, gw_cpu, wrk_cpu = (UPSTREAM_CPU, GATEWAY_CPU, CLIENT_CPU) if pinned else (None,) * 3
    bodies = {"text": REQUEST_BODY.encode(), "image": image_body()}
    if args.body != "both":
        bodies = {args.body: bodies[args.body]}

    print(machine_line())
    print(
        f"A: {args.base} ({_short(args.base)}); B: the working tree; wrk -t1 -c{CONNECTIONS} "
        f"-d{args.seconds:g}s, {args.rounds} rounds per body, order flipped each round; "
        f"pinned: {'yes' if pinned else 'no'}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name, stopping([]) as processes:
        tmp = Path(tmp_name)
        base_tree = tmp / "base"
        base_tree.mkdir()
        export_revision(args.base, base_tree)
        base_file, tree_file = imported_from(base_tree), imported_from(None)
        if not base_file.startswith(str(base_tree)) or tree_file.startswith(str(base_tree)):
            raise SystemExit(f"the arms do not import what they should: {base_file}, {tree_file}")
        print(f"A imports {base_file}; B imports {tree_file}")
        port = free_port()
        command = uvicorn_command("p7_proxies:make_upstream", HERE, port, up_cpu)
        command += ["--timeout-keep-alive", str(UPSTREAM_KEEP_ALIVE_S)]
        _started(processes, ServerProcess("upstream", command, port))
        arms = {
            "A": _started(processes, gateway(base_tree, port, gw_cpu)),
            "B": _started(processes, gateway(None, port, gw_cpu)),
        }
        for label, body in bodies.items():
            (tmp / f"{label}.body").write_bytes(body)
            script = tmp / f"{label}.lua"
            script.write_text(WRK_LUA.format(path=tmp / f"{label}.body", key=API_KEY))
            for arm in arms.values():
                run_wrk(arm.url, str(script), 1, CONNECTIONS, wrk_cpu)  # warm-up
            cpu_ms: dict[str, list[float]] = {"A": [], "B": []}
            for r in range(args.rounds):
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    pid = arms[name].process.pid
                    before = tree_cpu_seconds(pid)
                    run = run_wrk(arms[name].url, str(script), args.seconds, CONNECTIONS, wrk_cpu)
                    cpu_ms[name].append((tree_cpu_seconds(pid) - before) / run.requests * 1e3)
            a, b = statistics.median(cpu_ms["A"]), statistics.median(cpu_ms["B"])
            pairs = zip(cpu_ms["A"], cpu_ms["B"], strict=True)
            per_round = [after / before for before, after in pairs]
            rows.append((label, round(a, 3), round(b, 3), round(b / a, 3), spread(per_round)))

    print()
    print("CPU ms per request, medians over rounds; B ÷ A below 1: the working tree saves CPU")
    print(table(["body", "A (base)", "B (tree)", "B ÷ A", "per-round spread"], rows))
    for label, _, _, ratio, _ in rows:
        print(f"RESULT ab_serve_{label} ratio={ratio:.2f} target=none INFO")


def _short(revision: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", revision],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


if __name__ == "__main__":
    main()
