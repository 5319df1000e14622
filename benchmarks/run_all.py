"""Run the benchmarks one after another and print their RESULT lines together.

Usage: .venv/bin/python benchmarks/run_all.py [--quick]

Each benchmark runs in its own process (so one's memory and threads never skew
the next); its full output streams through, and the RESULT lines are repeated
at the end. Exits 0 whatever the results: benchmarks report, they do not gate.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (
    "p1_middleware_overhead.py",
    "p2_validate_vs_json_loads.py",
    "p3_vs_naive_validator.py",
    "p4_kimi_preprocess.py",
    "p5_batched_encode.py",
    "m1_fetch_overhead.py",
    "m2_decode_throughput.py",
    "p6_proxy_overhead.py",
    "p7_proxies.py",  # its peers from install_peers.sh; an absent one is skipped, said so
    "p8_image_checks.py",
    "p9_gate_cost.py",
    "p10_padded_images.py",
    "p11_hostile_bodies.py",
    "png_pixel_check.py",  # P12
    "p13_av_probe.py",
    "r1_ray_pool.py",
    "w1_workers.py",
    "media_ids.py",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of each (~20 s each)")
    args = parser.parse_args()

    results: list[str] = []
    start = time.perf_counter()
    for script in SCRIPTS:
        command = [sys.executable, str(HERE / script)] + (["--quick"] if args.quick else [])
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
        assert process.stdout is not None
        found = False
        for line in process.stdout:
            print(line, end="", flush=True)
            if line.startswith("RESULT "):
                results.append(line.rstrip())
                found = True
        process.wait()
        if not found:
            name = Path(script).stem
            results.append(f"RESULT {name} ratio=nan target=? FAIL (exit {process.returncode})")
        print()

    print(f"== summary ({time.perf_counter() - start:.0f} s{', quick' if args.quick else ''})")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
