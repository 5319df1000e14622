"""Media ids: what binding a client's ``uuid`` to its caller and bytes costs the gate.

Side by side in one run, interleaved rounds, the gate's whole decision
(``ModalGate(...).decider.decide``, as ``modalgate serve --engine vllm`` makes it) on a
chat with one ~1 MB photo (a noise JPEG):

- ``plain``: the image part without an id (nothing to bind: today's cost);
- ``bound``: the same part with ``uuid`` under the default ``media_ids: bind`` (a
  BLAKE3 digest of the decoded bytes, the keyed id, the body rewritten with it);
- ``passed``: the same part under ``media_ids: pass`` (the id forwarded as sent).

Also: the digest alone per MB (BLAKE3, beside SHA-256 for scale), and a reference by id
alone (no bytes: the memory's lookup and the rewrite). Target: bound / plain <= 2.0 (binding
adds a digest, one rewrite of the body and its thread hop: no more than the decision's own
cost on a photo).

Usage: .venv/bin/python benchmarks/media_ids.py [--quick]
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    begin,
    best,
    data_url,
    interleaved,
    noise_jpeg,
    result_line,
    spread,
    table,
)

from modalgate import ModalGate
from modalgate.policy import parse_policy

HEADERS = [(b"authorization", b"Bearer tenant-a")]
TARGET = 2.0  # bound decision / plain decision, one ~1 MB photo


async def _unused(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError


def _gate(mode: str) -> ModalGate:
    policy = parse_policy(f"extends: builtin\nmedia_ids: {{mode: {mode}}}", fmt="yaml")
    return ModalGate(_unused, policy=policy, engine="vllm", api_keys=())


def _body(photo: bytes, media_id: str | None) -> bytes:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(photo)}}
    if media_id is not None:
        part["uuid"] = media_id
    text = {"type": "text", "text": "What is in this photo?"}
    return orjson.dumps(
        {"model": "kimi-k3", "messages": [{"role": "user", "content": [text, part]}]}
    )


def main() -> None:
    args = begin("media ids: the cost of binding", __doc__ or "")
    rounds, reps = (3, 3) if args.quick else (9, 7)
    photo = noise_jpeg(1000, 92)
    print(f"photo: {len(photo) / 1e6:.2f} MB JPEG; {rounds} rounds of {reps}")
    loop = asyncio.new_event_loop()
    bind, passing = _gate("bind"), _gate("pass")
    plain, named = _body(photo, None), _body(photo, "photo-1")
    reference = orjson.dumps(
        {
            "model": "kimi-k3",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": None, "uuid": "photo-1"}],
                }
            ],
        }
    )

    def decide(gate: ModalGate, body: bytes) -> Any:
        return loop.run_until_complete(gate.decider.decide(body, "chat", None, None, HEADERS))

    bound = decide(bind, named)
    assert bound.forwards and orjson.loads(bound.body)["messages"][0]["content"][1]["uuid"] != (
        "photo-1"
    )
    assert decide(bind, reference).forwards and decide(passing, named).body == named

    started = time.perf_counter()
    bound_rounds = interleaved(
        lambda: decide(bind, named), lambda: decide(bind, plain), rounds, reps, lambda a, b: a / b
    )
    passed_rounds = interleaved(
        lambda: decide(passing, named),
        lambda: decide(bind, plain),
        rounds,
        reps,
        lambda a, b: a / b,
    )
    print(
        table(
            ("arm", "median ms", "vs plain", "spread"),
            [
                ("plain (no id)", statistics.median(bound_rounds.b) * 1e3, 1.0, "-"),
                (
                    "bound (uuid, bind)",
                    statistics.median(bound_rounds.a) * 1e3,
                    bound_rounds.ratio,
                    spread(bound_rounds.ratios),
                ),
                (
                    "passed (uuid, pass)",
                    statistics.median(passed_rounds.a) * 1e3,
                    passed_rounds.ratio,
                    spread(passed_rounds.ratios),
                ),
            ],
        )
    )
    reference_s = best(lambda: decide(bind, reference), 50)
    print(f"a reference by id alone: {reference_s * 1e6:.0f} us per decision")
    megabytes = os.urandom(16 << 20)
    per_mb = {
        "blake3": best(lambda: blake3.blake3(megabytes, max_threads=1).digest(), 5) / 16,
        "sha256": best(lambda: hashlib.sha256(megabytes).digest(), 5) / 16,
    }
    print(
        f"digest per MB: blake3 {per_mb['blake3'] * 1e3:.3f} ms, "
        f"sha256 {per_mb['sha256'] * 1e3:.3f} ms (one thread)"
    )
    print(f"{time.perf_counter() - started:.1f} s")
    print(result_line("media_ids", bound_rounds.ratio, "<=2.0", bound_rounds.ratio <= TARGET))


if __name__ == "__main__":
    main()
