"""The gate against the engines behind it, body by body: where do they disagree?

Each body of the corpus (``corpus.py``) is judged by the gate, as each model
under each engine configuration, and read by that engine's own parsing code
(``engines.py``, run in ``.venv-conformance``: one process for all engine
configurations, the engines imported once). Per body the outcome is one of:

- ``agree``: both accept (and the engine extracts only what the model takes), or
  both refuse;
- ``bypass``: the gate accepts what the engine refuses, or accepts a body from
  which the engine extracts a modality the model does not take;
- ``false reject``: the gate refuses, for its own reading of the parts, a body
  the engine accepts with only modalities the model takes;
- ``limits``: the same, refused by a policy limit or a media check (counts,
  roles, URLs, bytes): the gate's business, not a disagreement on shapes.

    python tests/conformance/differential.py [--count N] [--seed S] [--show bypass]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINE_PYTHON = ROOT / ".venv-conformance" / "bin" / "python"
for _where in (str(ROOT), str(HERE.parent), str(HERE)):
    if _where not in sys.path:
        sys.path.insert(0, _where)

import corpus  # noqa: E402
from modalgate.errors import ErrorCode  # noqa: E402
from modalgate.policy import RuleMatcher, load_policy, parse_policy  # noqa: E402
from modalgate.validators.dialects import EngineSpec, dialect_for  # noqa: E402
from modalgate.validators.request import validate_body  # noqa: E402
from modalgate.validators.verdict import Verdict  # noqa: E402


@dataclass(frozen=True)
class EngineConfig:
    name: str
    spec: EngineSpec

    def engines_py(self) -> dict[str, Any]:
        """The configuration as engines.py's ``view_of`` takes it."""
        return {
            "engine": self.spec.name,
            "enable_mm_embeds": self.spec.enable_mm_embeds,
            "enable_prompt_embeds": self.spec.enable_prompt_embeds,
            "trust_request_mm_kwargs": self.spec.trust_request_mm_kwargs,
        }


ENGINE_CONFIGS = (
    EngineConfig("vllm", EngineSpec(name="vllm")),
    EngineConfig("vllm+mm-embeds", EngineSpec(name="vllm", enable_mm_embeds=True)),
    EngineConfig("vllm+prompt-embeds", EngineSpec(name="vllm", enable_prompt_embeds=True)),
    EngineConfig("vllm+trust-mm-kwargs", EngineSpec(name="vllm", trust_request_mm_kwargs=True)),
    EngineConfig(
        "vllm+all",
        EngineSpec(
            name="vllm",
            enable_mm_embeds=True,
            enable_prompt_embeds=True,
            trust_request_mm_kwargs=True,
        ),
    ),
    EngineConfig("sglang", EngineSpec(name="sglang")),
)


@dataclass(frozen=True)
class GateModel:
    label: str
    model: str
    mode: str | None
    accepts: frozenset[str]


# A rule that takes precomputed embeddings too, so that the embeds paths are judged
# as accepted somewhere; the others come from the built-in table.
EMBEDS_RULE = """
extends: builtin
models:
  - name: vl-embeds
    accepts: [image, video, embeddings]
"""
GATE_MODELS = (
    GateModel("kimi-k3 (encoder mode)", "kimi-k3", "encoder", frozenset({"image"})),
    GateModel("qwen2.5-vl (image+video)", "qwen2.5-vl", None, frozenset({"image", "video"})),
    GateModel(
        "qwen2.5-omni (image+video+audio)",
        "qwen2.5-omni",
        None,
        frozenset({"image", "video", "audio"}),
    ),
    GateModel(
        "vl-embeds (image+video+embeddings)",
        "vl-embeds",
        None,
        frozenset({"image", "video", "embeddings"}),
    ),
)
# Refusals that are policy limits or checks of the media themselves, not of shapes.
LIMIT_CODES = frozenset(
    {
        ErrorCode.TOO_MANY_MEDIA,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.ROLE_NOT_ALLOWED,
        ErrorCode.URL_NOT_ALLOWED,
        ErrorCode.INVALID_BASE64,
        ErrorCode.INVALID_IMAGE,
        ErrorCode.UNSUPPORTED_IMAGE_FORMAT,
        ErrorCode.ANIMATED_IMAGE,
        ErrorCode.IMAGE_TOO_LARGE,
        ErrorCode.IMAGE_TOO_SMALL,
        ErrorCode.TOO_MANY_IMAGE_TOKENS,
        ErrorCode.MODALITY_MISMATCH,
        ErrorCode.MEDIA_FETCH_FAILED,
    }
)
OUTCOMES = ("agree", "bypass", "false reject", "limits")


def engine_views(
    bodies: list[dict[str, Any]], configs: Iterable[EngineConfig] = ENGINE_CONFIGS
) -> list[dict[str, dict[str, Any]]]:
    """Every configuration's view of every body: one engines.py process in all."""
    lines = "".join(json.dumps(b) + "\n" for b in bodies)
    matrix = {c.name: c.engines_py() for c in configs}
    done = subprocess.run(
        [str(ENGINE_PYTHON), str(HERE / "engines.py"), "--configs", json.dumps(matrix)],
        input=lines,
        capture_output=True,
        text=True,
        timeout=900,
    )
    views = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or len(views) != len(bodies):
        raise RuntimeError(f"engines.py failed ({done.returncode}): {done.stderr[-3000:]}")
    return views


def extracted(view: dict[str, Any], body: dict[str, Any], engine: str) -> set[str]:
    """The modalities the engine takes from the body. SGLang hands a top-level
    ``use_audio_in_video`` to the model's processor, after the parsing run here: each
    video is taken to carry its audio track then (an omni model's processor does)."""
    found = {m for m, n in view["modalities"].items() if n}
    if engine == "sglang" and body.get("use_audio_in_video") and "video" in found:
        found.add("audio")
    return found


def outcome(
    verdict: Verdict, view: dict[str, Any], found: set[str], accepts: frozenset[str]
) -> str:
    extracted = found
    engine_takes = view["accepted"] and extracted <= accepts
    if verdict.accepted:
        return "agree" if engine_takes else "bypass"
    if not engine_takes:
        return "agree"
    codes = {v.code for v in verdict.violations}
    return "limits" if codes <= LIMIT_CODES else "false reject"


@dataclass
class Report:
    counts: dict[tuple[str, str], Counter[str]]
    found: list[dict[str, Any]]  # one row per disagreement (bypass or false reject)

    def table(self) -> str:
        rows = ["| model | engine | bodies | agree | bypass | false reject | limits |"]
        rows.append("|---|---|---:|---:|---:|---:|---:|")
        for (model, engine), count in self.counts.items():
            cells = " | ".join(str(count[o]) for o in OUTCOMES)
            rows.append(f"| {model} | {engine} | {sum(count.values())} | {cells} |")
        return "\n".join(rows)

    def total(self, kind: str) -> int:
        return sum(count[kind] for count in self.counts.values())


def cached_engine_views(bodies: list[dict[str, Any]], cache: Path | None) -> list[Any]:
    """``engine_views``, kept in ``cache`` for the same bodies and engines.py (a rerun
    after a change to the gate alone skips the engines)."""
    if cache is None:
        return engine_views(bodies)
    key = hashlib.sha256(
        json.dumps(bodies, sort_keys=True).encode() + (HERE / "engines.py").read_bytes()
    ).hexdigest()
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["views"]
    views = engine_views(bodies)
    cache.write_text(json.dumps({"key": key, "views": views}))
    return views


def run(
    count: int = corpus.RANDOM_BODIES, seed: int = corpus.SEED, cache: Path | None = None
) -> Report:
    cases = corpus.build(count, seed)
    views = cached_engine_views([{"model": "m", **body} for _, body in cases], cache)
    policy = parse_policy(EMBEDS_RULE, fmt="yaml") if EMBEDS_RULE else load_policy()
    counts: dict[tuple[str, str], Counter[str]] = {}
    found: list[dict[str, Any]] = []
    for gate_model in GATE_MODELS:
        matcher = RuleMatcher(policy, gate_model.mode)
        for config in ENGINE_CONFIGS:
            dialect = dialect_for(config.spec)
            tally = counts.setdefault((gate_model.label, config.name), Counter())
            for (label, body), by_config in zip(cases, views, strict=True):
                raw = json.dumps({"model": gate_model.model, **body}).encode()
                verdict = validate_body(raw, matcher, dialect=lambda _rule, d=dialect: d)
                view = by_config[config.name]
                taken = extracted(view, body, config.spec.name)
                result = outcome(verdict, view, taken, gate_model.accepts)
                tally[result] += 1
                if result in ("bypass", "false reject"):
                    found.append(
                        {
                            "outcome": result,
                            "model": gate_model.model,
                            "engine": config.name,
                            "case": label,
                            "body": body,
                            "gate": [v.as_dict() for v in verdict.violations][:2],
                            "engine_view": view,
                        }
                    )
    return Report(counts, found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=corpus.RANDOM_BODIES, help="random bodies")
    parser.add_argument("--seed", type=int, default=corpus.SEED)
    parser.add_argument("--show", choices=("bypass", "false reject"), action="append", default=[])
    parser.add_argument(
        "--cache", type=Path, default=None, help="keep the engines' views in this file"
    )
    args = parser.parse_args(argv)
    if not ENGINE_PYTHON.exists():
        sys.stderr.write(f"{ENGINE_PYTHON} is missing: bash tests/conformance/install.sh\n")
        return 2
    report = run(args.count, args.seed, args.cache)
    for row in report.found:
        if row["outcome"] in args.show:
            sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.write(report.table() + "\n")
    sys.stdout.write(
        f"bodies per cell: {len(corpus.HAND_WRITTEN)} hand-written + {args.count} random"
        f" (seed {args.seed}); bypasses: {report.total('bypass')};"
        f" false rejects: {report.total('false reject')}\n"
    )
    return 0 if not report.total("bypass") and not report.total("false reject") else 1


if __name__ == "__main__":
    sys.exit(main())
