"""The family-processor property run at length: 10,000 images per built-in family.

``tests/validators/test_family_processors.py`` checks, for every token family of the
built-in table, that an image the gate accepts is processed by the model's own
transformers processor with exactly the image tokens the gate estimated, and that an
image the processor fails on is refused. CI runs 500 images per family of at most
1 MP; this runs the same properties with more images and larger ones (16 MP by
default), and prints, per family, how many were compared, refused and refused for
their shape, with the CPU seconds each took. Not a speed benchmark: it ends with

    RESULT family_processors families=<n> examples=<n> PASS|FAIL

and exits 1 when a property failed (the failing image is printed, shrunk).

    python benchmarks/family_processors.py                    # 10,000 per family
    python benchmarks/family_processors.py --examples 500 --max-pixels 1048576   # CI's run
    python benchmarks/family_processors.py --only llama-4,internvl3
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--max-pixels", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--only", default="", help="comma-separated family names")
    args = parser.parse_args()

    # The test module reads its caps when imported.
    os.environ["MODALGATE_FAMILY_MAX_PIXELS"] = str(args.max_pixels)
    sys.path[:0] = [str(TESTS), str(TESTS / "validators")]
    import test_family_processors as families  # after the environment is set

    everything = [*families.FAMILIES, "openai-tiles"]
    names = [n for n in args.only.split(",") if n] or everything
    print(f"{args.examples} images per family, at most {args.max_pixels} pixels each")
    print(f"{'family':<20} {'compared':>9} {'refused':>8} {'shape':>6} {'cpu s':>7}  result")
    failed = 0
    for name in names:
        if name != "openai-tiles":
            families.processor_for(name)
        start = resource.getrusage(resource.RUSAGE_SELF).ru_utime
        try:
            if name == "openai-tiles":  # no processor: the published formula
                seen = families.run_openai(args.examples)
            else:
                seen = families.run_family(name, args.examples)
            result = "PASS"
        except Exception:  # a property failed: hypothesis printed the shrunk image
            traceback.print_exc(limit=1)
            seen, result = {}, "FAIL"
            failed += 1
        cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - start
        print(
            f"{name:<20} {seen.get('compared', 0):>9} {seen.get('refused', 0):>8} "
            f"{seen.get('refused_shape', 0):>6} {cpu:>7.1f}  {result}",
            flush=True,
        )
    verdict = "FAIL" if failed else "PASS"
    print(f"RESULT family_processors families={len(names)} examples={args.examples} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
