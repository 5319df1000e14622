"""P3: modalgate's validate_body vs a naive validator that decodes every image in full.

The naive validator is what a careful first version looks like: a pydantic v2
model of the chat request (messages whose content is a string or a list of
parts, the parts a union discriminated by ``type``, image_url among them),
then for every image part a full ``base64.b64decode`` and a full Pillow decode
(``Image.open(...).convert("RGB")``), then the same checks modalgate makes
(modality allowed for the model, image count, bytes, pixels, minimum side).
Both must accept the same ~10 MB four-JPEG body (asserted).

Ratio = naive time / modalgate time (per round: median of the reps).
Target: >= 10.

Usage: .venv/bin/python benchmarks/p3_vs_naive_validator.py [--quick]
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import time
from typing import Annotated, Literal

from _common import (
    DEFAULT_QUALITY,
    DEFAULT_SIDE,
    build_big_body,
    describe_body,
    interleaved,
    machine_line,
    print_rounds,
    result_line,
    table,
    time_call,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import validate_body

NAME = "p3_vs_naive_validator"
TARGET = 10.0

# ---------------------------------------------------------------- the naive validator


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: str
    format: str


class AudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaURL(BaseModel):
    url: str


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: MediaURL


class AudioURLPart(_Part):
    type: Literal["audio_url"]
    audio_url: MediaURL


ContentPart = Annotated[
    TextPart | ImagePart | AudioPart | VideoPart | AudioURLPart, Field(discriminator="type")
]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message] = Field(min_length=1)


# What the naive version knows about models: a dict, the same facts the built-in
# policy holds for kimi-k3 in encoder mode.
NAIVE_POLICY = {
    "kimi-k3": {
        "accepts": {"image"},
        "max_images": 16,
        "max_image_bytes": 32 * 1024 * 1024,
        "max_image_pixels": (512 * 14) ** 2,
        "min_image_side": 2,
        "formats": {"JPEG", "PNG", "WEBP", "GIF"},
    }
}
_MODALITY = {ImagePart: "image", AudioPart: "audio", VideoPart: "video", AudioURLPart: "audio"}


def naive_validate(body: bytes) -> list[str]:
    """Errors found (empty: accepted)."""
    try:
        request = ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        return [str(exc)]
    rule = NAIVE_POLICY.get(request.model.lower())
    if rule is None:
        return []
    errors: list[str] = []
    images = 0
    for i, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            where = f"messages.[{i}].content.[{j}]"
            modality = _MODALITY.get(type(part))
            if modality is None:
                continue
            if modality not in rule["accepts"]:
                errors.append(f"{where}: {modality} input is not supported by {request.model}")
                continue
            assert isinstance(part, ImagePart)
            images += 1
            errors.extend(_check_image(part.image_url.url, where, rule))
    if images > rule["max_images"]:
        errors.append(f"too many images: {images} > {rule['max_images']}")
    return errors


def _check_image(url: str, where: str, rule: dict) -> list[str]:
    if not url.startswith("data:"):
        return []  # remote URLs: out of scope here
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        return [f"{where}: data URL is not base64"]
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return [f"{where}: invalid base64"]
    if len(raw) > rule["max_image_bytes"]:
        return [f"{where}: image too large ({len(raw)} bytes)"]
    try:
        with Image.open(io.BytesIO(raw)) as image:
            image_format = image.format
            rgb = image.convert("RGB")  # full decode: reads every pixel
    except Exception:
        return [f"{where}: invalid image"]
    width, height = rgb.size
    if image_format not in rule["formats"]:
        return [f"{where}: {image_format} images are not accepted"]
    if width * height > rule["max_image_pixels"]:
        return [f"{where}: image too large ({width}x{height})"]
    if min(width, height) < rule["min_image_side"]:
        return [f"{where}: image too small ({width}x{height})"]
    return []


# ---------------------------------------------------------------- the benchmark


def naive_breakdown(body: bytes) -> list[tuple[str, float]]:
    """One naive run, split by stage (seconds)."""
    request_time = time_call(lambda: ChatRequest.model_validate_json(body))
    request = ChatRequest.model_validate_json(body)
    urls = [
        part.image_url.url
        for message in request.messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, ImagePart)
    ]
    payloads = [url.partition(",")[2] for url in urls]
    b64_time = time_call(lambda: [base64.b64decode(p, validate=True) for p in payloads])
    raws = [base64.b64decode(p, validate=True) for p in payloads]

    def decode_all() -> None:
        for raw in raws:
            with Image.open(io.BytesIO(raw)) as image:
                image.convert("RGB")

    pillow_time = time_call(decode_all)
    return [
        ("pydantic model_validate_json", request_time),
        ("base64.b64decode x4", b64_time),
        ("Pillow open+convert('RGB') x4", pillow_time),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None, help="calls of each per round")
    parser.add_argument("--side", type=int, default=DEFAULT_SIDE, help="JPEG side in pixels")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    reps = args.reps or (1 if args.quick else 3)

    body, images = build_big_body(args.side, DEFAULT_QUALITY)
    matcher = RuleMatcher(load_policy(), "encoder")
    verdict = validate_body(body, matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    assert len(verdict.parts) == 4
    del verdict
    naive_errors = naive_validate(body)
    assert not naive_errors, naive_errors
    # Both refuse the same video request, so they are doing the same job.
    video = (
        b'{"model":"kimi-k3","messages":[{"role":"user","content":[{"type":"video_url",'
        b'"video_url":{"url":"https://example.com/a.mp4"}}]}]}'
    )
    assert naive_validate(video) and not validate_body(video, matcher).accepted

    print(f"== {NAME}")
    print(machine_line())
    print(describe_body(body, images, args.side, DEFAULT_QUALITY))
    print("naive: pydantic v2 model_validate_json + base64.b64decode + Pillow convert('RGB')")
    print("modalgate: validate_body(body, RuleMatcher(load_policy(), 'encoder')); both accept")
    print(f"{rounds} rounds x {reps} reps, interleaved; per round the median of each")

    for _ in range(2):  # warm-up
        naive_validate(body)
        validate_body(body, matcher)

    start = time.perf_counter()
    result = interleaved(
        lambda: naive_validate(body),
        lambda: validate_body(body, matcher),
        rounds=rounds,
        reps=reps,
        ratio=lambda naive, gate: naive / gate,
    )
    elapsed = time.perf_counter() - start

    print_rounds(result, "naive", "modalgate", elapsed)
    print("\nnaive validator, one run by stage:")
    print(table(("stage", "ms"), [(label, t * 1e3) for label, t in naive_breakdown(body)]))
    print(result_line(NAME, result.ratio, f">={TARGET:g}", result.ratio >= TARGET))


if __name__ == "__main__":
    main()
