"""The real-server differential, and the gate's cost next to a real server's (issue: <= 2%).

Every body of the corpus (tests/realserver/bodies.py) goes to the model server
directly and through ``modalgate serve``; the table says which the gate protected,
which got past it (bypass), which it refused that the server takes (false reject),
and which both take. Then the clean bodies (both fine) are sent again, direct and
gated in turn, and the gate's CPU per request (its process's user+system time) is
set against the server's time per request: for the gate as configured, and beside it
the same gate with its verdict cache off (``verdict_cache.enabled: false``), so the
rounds after the first, which resend the same images, show what the cache saves.

    python benchmarks/realserver_differential.py              # builds a tiny Qwen2-VL,
                                                              # runs transformers serve
    python benchmarks/realserver_differential.py --upstream http://127.0.0.1:8001 \\
        --model Qwen/Qwen2-VL-2B-Instruct [--policy policy.yaml]   # your own server

Against your own server a body that kills it ends the run (it is not restarted).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from gateway_proc import GatewayProcess
from realserver.bodies import corpus
from realserver.expected import reason_for
from realserver.outcomes import CHAT, Reply, Table, post, post_direct


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def overhead(client: httpx.Client, direct_url: str, gate: GatewayProcess, bodies, rounds: int):
    """(gate CPU per request, server wall time per request): the clean bodies sent direct,
    then gated, in turn; CPU read per block (the kernel counts it in 10 ms ticks)."""
    gate_cpu = direct_wall = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        for body in bodies:
            assert post(client, direct_url + CHAT, body, lambda: True).fine
        direct_wall += time.perf_counter() - started
        before = cpu_seconds(gate.process.pid)
        for body in bodies:
            assert post(client, gate.url + CHAT, body, lambda: True).fine
        gate_cpu += cpu_seconds(gate.process.pid) - before
    count = rounds * len(bodies)
    return gate_cpu / count, direct_wall / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", help="your model server (default: a tiny one, built here)")
    parser.add_argument("--model", help="the model name your server serves")
    parser.add_argument("--policy", help="policy file for the gate (default: built-in)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the clean bodies")
    args = parser.parse_args()
    stop = []
    if args.upstream:
        if not args.model:
            parser.error("--model is needed with --upstream")
        direct_url, behind_url, model = args.upstream.rstrip("/"), args.upstream, args.model
        direct = None
        gate_args = ["--upstream", behind_url] + (["--policy", args.policy] if args.policy else [])
    else:
        from realserver.servers import ForkedServe, TransformersServe, policy_text
        from realserver.tiny_vlm import build_qwen2_vl

        folder = Path(tempfile.mkdtemp(prefix="realserver-"))
        model_dir = build_qwen2_vl(folder / "tiny-qwen2-vl")
        policy = folder / "policy.yaml"
        policy.write_text(policy_text(model_dir))
        behind = TransformersServe(model_dir)
        direct = ForkedServe(model_dir)
        stop += [behind.stop, direct.stop]
        direct_url, behind_url, model = behind.url, behind.url, str(model_dir)
        gate_args = ["--upstream", behind_url, "--policy", args.policy or str(policy)]
    gate = GatewayProcess(*gate_args).wait_ready()
    stop.append(gate.stop)
    uncached = _uncached_gate(gate_args)
    stop.append(uncached.stop)
    table = Table()
    try:
        with httpx.Client(timeout=120) as client:
            started = time.perf_counter()
            for name, body in corpus(model):
                if direct is not None:
                    direct_reply = post_direct(client, direct, body)
                else:
                    direct_reply = post(client, direct_url + CHAT, body, lambda: True)
                gated: Reply = post(client, gate.url + CHAT, body, lambda: True)
                table.add(name, direct_reply, gated)
                if direct is None and direct_reply.failed and direct_reply.status == "died":
                    print(f"{name} killed the server: stopping here", file=sys.stderr)
                    break
            print(f"corpus: {time.perf_counter() - started:.0f} s")
            print(table.render())
            unexplained = [
                name for name, _, g, _ in table.of("false reject") if not reason_for(name, g.code)
            ]
            print(f"false rejects without a documented reason: {len(unexplained)} {unexplained}")
            fine = {name for name, *_ in table.of("both fine")}
            clean = [body for name, body in corpus(model) if name in fine]
            for label, measured in (("verdict cache off", uncached), ("as configured", gate)):
                if not clean:
                    break
                gate_cpu, server_wall = overhead(client, direct_url, measured, clean, args.rounds)
                share = gate_cpu / server_wall
                verdict = "PASS" if share <= 0.02 else "FAIL"
                print(
                    f"overhead ({label}): {len(clean)} clean bodies x {args.rounds}: gate CPU "
                    f"{gate_cpu * 1e3:.2f} ms per request, server {server_wall * 1e3:.1f} ms "
                    f"per request: {share:.2%} (target <= 2%: {verdict})"
                )
    finally:
        for end in reversed(stop):
            end()
    return 0 if not table.of("bypass") and not table.of("gate 5xx") else 1


def _uncached_gate(gate_args: list[str]) -> GatewayProcess:
    """The same gate with its verdict cache off: the policy given (or the built-in one)
    with ``verdict_cache.enabled: false`` on top."""
    args = list(gate_args)
    folder = Path(tempfile.mkdtemp(prefix="realserver-uncached-"))
    if "--policy" in args:
        at = args.index("--policy") + 1
        text = Path(args[at]).read_text()
    else:
        at, text = len(args) + 1, "extends: builtin\n"
        args.append("--policy")
        args.append("")
    path = folder / "policy.yaml"
    path.write_text(text + "\nverdict_cache: {enabled: false}\n")
    args[at] = str(path)
    return GatewayProcess(*args).wait_ready()


if __name__ == "__main__":
    raise SystemExit(main())
