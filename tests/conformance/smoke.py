"""Hand-written chat bodies through both engines' parsing: a table of what each says.

    python tests/conformance/smoke.py            # markdown table on stdout
    python tests/conformance/smoke.py --json     # the raw views

Runs with any Python: the engines run in ``.venv-conformance`` through
``engines.py``'s command line, one process per engine configuration.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINE_PYTHON = HERE.parents[1] / ".venv-conformance" / "bin" / "python"

PNG = (  # a 1x1 PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwAB"
    "BAEAHnOcQAAAAABJRU5ErkJggg=="
)
B64 = "AAAA"  # stands for any base64 payload: nothing is decoded


def user(*parts: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], **extra}


TEXT = {"type": "text", "text": "describe"}
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("text only (string)", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("text part", user(TEXT)),
    ("image_url object", user(TEXT, {"type": "image_url", "image_url": {"url": PNG}})),
    ("image_url string", user(TEXT, {"type": "image_url", "image_url": PNG})),
    ("image_url https", user({"type": "image_url", "image_url": {"url": "https://x.test/a.png"}})),
    ("video_url", user(TEXT, {"type": "video_url", "video_url": {"url": "https://x.test/v.mp4"}})),
    ("audio_url", user({"type": "audio_url", "audio_url": {"url": "https://x.test/a.wav"}})),
    (
        "input_audio wav",
        user({"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}),
    ),
    (
        "input_audio mp3",
        user({"type": "input_audio", "input_audio": {"data": B64, "format": "mp3"}}),
    ),
    (
        "input_audio flac",
        user({"type": "input_audio", "input_audio": {"data": B64, "format": "flac"}}),
    ),
    ("typeless image_url", user({"image_url": {"url": PNG}})),
    ("typeless video_url", user({"video_url": {"url": "https://x.test/v.mp4"}})),
    ("typeless image_url string", user({"image_url": PNG})),
    ("typeless video_url string", user({"video_url": "https://x.test/v.mp4"})),
    ("typeless audio_url string", user({"audio_url": "https://x.test/a.wav"})),
    ("typeless text", user({"text": "hi"})),
    ("typeless + uuid, image_url object", user({"image_url": {"url": PNG}, "uuid": "u"})),
    (
        "uuid: text type + video_embeds",
        user({"type": "text", "text": "x", "uuid": "u", "video_embeds": B64}),
    ),
    ("uuid: image_url null", user({"type": "image_url", "image_url": None, "uuid": "u"})),
    (
        "uuid: typed video_url",
        user({"type": "video_url", "video_url": {"url": "https://x.test/v.mp4"}, "uuid": "u"}),
    ),
    ("file part", user({"type": "file", "file": {"file_data": B64, "filename": "a.pdf"}})),
    ("input_text", user({"type": "input_text", "text": "hi"})),
    ("input_image", user({"type": "input_image", "image_url": PNG})),
    ("input_image + detail", user({"type": "input_image", "image_url": PNG, "detail": "auto"})),
    (
        "detail original",
        user({"type": "image_url", "image_url": {"url": PNG, "detail": "original"}}),
    ),
    ("detail default", user({"type": "image_url", "image_url": {"url": PNG, "detail": "default"}})),
    ("detail bogus", user({"type": "image_url", "image_url": {"url": PNG, "detail": "max"}})),
    ("image_embeds", user({"type": "image_embeds", "image_embeds": B64})),
    ("video_embeds", user({"type": "video_embeds", "video_embeds": B64})),
    ("audio_embeds", user({"type": "audio_embeds", "audio_embeds": B64})),
    ("prompt_embeds part", user(TEXT, {"type": "prompt_embeds", "data": B64})),
    (
        "image + image_embeds",
        user(
            {"type": "image_url", "image_url": {"url": PNG}},
            {"type": "image_embeds", "image_embeds": B64},
        ),
    ),
    (
        "use_audio_in_video (mm_processor_kwargs)",
        user(
            {"type": "video_url", "video_url": {"url": "https://x.test/v.mp4"}},
            mm_processor_kwargs={"use_audio_in_video": True},
        ),
    ),
    (
        "image in system message",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": PNG}}]},
                {"role": "user", "content": "hi"},
            ],
        },
    ),
    ("image_pil", user({"type": "image_pil", "image_pil": B64})),
    ("unknown type", user({"type": "hologram", "hologram": B64})),
    ("empty messages", {"model": "m", "messages": []}),
]

CONFIGS: list[tuple[str, list[str]]] = [
    ("vllm", ["--engine", "vllm"]),
    ("vllm+embeds", ["--engine", "vllm", "--enable-mm-embeds", "--enable-prompt-embeds"]),
    ("sglang", ["--engine", "sglang"]),
]


def run(args: list[str], bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    lines = "".join(json.dumps(b) + "\n" for b in bodies)
    done = subprocess.run(
        [str(ENGINE_PYTHON), str(HERE / "engines.py"), *args],
        input=lines,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    views = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(views) == len(bodies), (len(views), done.stderr[-2000:])
    return views


def cell(view: dict[str, Any]) -> str:
    if not view["accepted"]:
        error = (view["error"] or "").replace("|", "/")
        return f"{view['status']} {view['stage']}: {error[:90]}"
    found = [f"{k}={n}" for k, n in view["modalities"].items() if n]
    return "ok " + (", ".join(found) if found else "text")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    bodies = [b for _, b in BODIES]
    results = {name: run(cli, bodies) for name, cli in CONFIGS}
    if args.json:
        for i, (label, body) in enumerate(BODIES):
            row = {"case": label, "body": body, **{n: results[n][i] for n, _ in CONFIGS}}
            sys.stdout.write(json.dumps(row) + "\n")
        return 0
    names = [n for n, _ in CONFIGS]
    sys.stdout.write("| case | " + " | ".join(names) + " |\n")
    sys.stdout.write("|---" * (len(names) + 1) + "|\n")
    for i, (label, _) in enumerate(BODIES):
        cells = [cell(results[n][i]) for n in names]
        sys.stdout.write(f"| {label} | " + " | ".join(cells) + " |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
