"""P2: full modalgate validation of a ~10 MB, four-image request vs a bare ``json.loads``.

``validate_body`` parses the body, walks the messages, decodes every base64 data
URL, sniffs the bytes and reads each JPEG header. The target says all of that
should cost no more than the stdlib ``json.loads`` any Python server already
pays for the same bytes.

Ratio = validate_body time / json.loads time (per round: median of the reps).
Target: <= 1.0.

Usage: .venv/bin/python benchmarks/p2_validate_vs_json_loads.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

from _common import (
    DEFAULT_QUALITY,
    DEFAULT_SIDE,
    build_big_body,
    describe_body,
    interleaved,
    machine_line,
    print_rounds,
    result_line,
    spread,
    table,
)
from pydantic_core import from_json

from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import validate_body

NAME = "p2_validate_vs_json_loads"
TARGET = 1.0


STAGES = (
    # label, function name (substring for built-ins), file it lives in
    ("from_json (JSON parse)", "from_json", "~"),
    ("walk messages (_walk_messages)", "_walk_messages", "validators/request.py"),
    ("cheap tier (cheap_violations)", "cheap_violations", "validators/media_checks.py"),
    ("  parse_data_url (payload slice)", "parse_data_url", "media/data_url.py"),
    ("probe tier (probe_violations)", "probe_violations", "validators/media_checks.py"),
    ("  base64 decode (decode_base64)", "decode_base64", "media/data_url.py"),
    ("  sniff magic bytes (sniff)", "sniff", "media/sniff.py"),
    ("  JPEG header (probe_image)", "probe_image", "validators/image_probe.py"),
)


def stage_breakdown(body: bytes, matcher: RuleMatcher, reps: int) -> list[tuple[str, float]]:
    """Where validate_body's time goes, from cProfile: cumulative seconds per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        validate_body(body, matcher)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]

    def cumulative(name: str, where: str) -> float:
        return sum(
            entry[3]
            for (filename, _line, funcname), entry in stats.items()
            if (name in funcname if where == "~" else funcname == name) and filename.endswith(where)
        )

    rows = [("validate_body (total)", cumulative("validate_body", "validators/request.py"))]
    rows += [(label, cumulative(name, where)) for label, name, where in STAGES]
    return [(label, seconds / reps) for label, seconds in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None, help="calls of each per round")
    parser.add_argument("--side", type=int, default=DEFAULT_SIDE, help="JPEG side in pixels")
    parser.add_argument("--profile", action="store_true", help="print a cProfile stage breakdown")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 21)
    reps = args.reps or (3 if args.quick else 7)

    body, images = build_big_body(args.side, DEFAULT_QUALITY)
    matcher = RuleMatcher(load_policy(), "encoder")
    verdict = validate_body(body, matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    assert len(verdict.parts) == 4 and all(p.format == "jpeg" for p in verdict.parts)
    assert json.loads(body)["model"] == "kimi-k3"
    del verdict

    print(f"== {NAME}")
    print(machine_line())
    print(describe_body(body, images, args.side, DEFAULT_QUALITY))
    print("validate_body(body, RuleMatcher(load_policy(), 'encoder')), model kimi-k3: accepted")
    print(f"{rounds} rounds x {reps} reps, interleaved; per round the median of each")

    # Warm both paths (first-touch page faults, Pillow plugin imports).
    for _ in range(2):
        validate_body(body, matcher)
        json.loads(body)

    start = time.perf_counter()
    result = interleaved(
        lambda: validate_body(body, matcher),
        lambda: json.loads(body),
        rounds=rounds,
        reps=reps,
        ratio=lambda validate, loads: validate / loads,
    )
    elapsed = time.perf_counter() - start

    print_rounds(result, "validate", "json.loads", elapsed)
    # Context for the ratio: the parse validate_body does, alone, against the same baseline.
    parse_only = interleaved(
        lambda: from_json(body, allow_inf_nan=False),
        lambda: json.loads(body),
        rounds=max(3, rounds // 3),
        reps=reps,
        ratio=lambda fast, loads: fast / loads,
    )
    print(
        f"reference: pydantic_core.from_json alone / json.loads = {parse_only.ratio:.2f} "
        f"(spread {spread(parse_only.ratios)}); from_json "
        f"{statistics.median(parse_only.a) * 1e3:.1f} ms"
    )
    if args.profile or result.ratio > TARGET:
        print("\nwhere validate_body's time goes (cProfile, ms per call, profiler overhead incl.):")
        breakdown = stage_breakdown(body, matcher, reps=3 if args.quick else 10)
        total = breakdown[0][1] or 1.0
        print(
            table(
                ("stage", "ms", "share"),
                [(label, t * 1e3, f"{t / total:.0%}") for label, t in breakdown],
            )
        )
    print(result_line(NAME, result.ratio, f"<={TARGET}", result.ratio <= TARGET))


if __name__ == "__main__":
    main()
