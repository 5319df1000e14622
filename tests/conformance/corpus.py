"""Chat bodies for the differential suite: hand-written edge cases plus seeded random ones.

The payloads are real and well formed (a PNG data URL, a WAV's base64, public
https URLs), so that what the gate and an engine disagree on is the body's
shape, not its bytes: engines never look at payloads, the gate's media checks do.
``model`` is left out: the runner names the model each body is judged as.

    python tests/conformance/corpus.py --count 600 > bodies.jsonl
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from typing import Any

import pybase64
from PIL import Image

from media_stubs import WAV_BYTES

SEED = 13
RANDOM_BODIES = 520

Body = dict[str, Any]
Part = Any


def _png_data_url(side: int = 64) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buffer, "PNG")
    return "data:image/png;base64," + pybase64.b64encode(buffer.getvalue()).decode()


PNG = _png_data_url()
IMAGE_URL = "https://example.com/a.png"
VIDEO_URL = "https://example.com/v.mp4"
AUDIO_URL = "https://example.com/a.wav"
WAV_B64 = pybase64.b64encode(WAV_BYTES).decode()
TENSOR_B64 = "AAAA"  # stands for a serialized tensor: nobody decodes it here
TEXT: Part = {"type": "text", "text": "describe"}


def user(*parts: Part, **extra: Any) -> Body:
    return {"messages": [{"role": "user", "content": list(parts)}], **extra}


def _url(kind: str, url: str, **extra: Any) -> Part:
    return {"type": kind, kind: {"url": url, **extra}}


def _audio(fmt: Any, data: Any = WAV_B64) -> Part:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


HAND_WRITTEN: list[tuple[str, Body]] = [
    ("text only (string)", {"messages": [{"role": "user", "content": "hi"}]}),
    ("text part", user(TEXT)),
    ("bare string part", user("hello")),
    ("image_url object", user(TEXT, _url("image_url", PNG))),
    ("image_url https", user(_url("image_url", IMAGE_URL))),
    ("image_url string", user(TEXT, {"type": "image_url", "image_url": PNG})),
    ("image_url null", user({"type": "image_url", "image_url": None})),
    ("image_url object without url", user({"type": "image_url", "image_url": {}})),
    ("image_url url null", user({"type": "image_url", "image_url": {"url": None}})),
    ("image_url url int", user({"type": "image_url", "image_url": {"url": 3}})),
    ("video_url object", user(TEXT, _url("video_url", VIDEO_URL))),
    ("video_url string", user({"type": "video_url", "video_url": VIDEO_URL})),
    ("audio_url object", user(_url("audio_url", AUDIO_URL))),
    ("audio_url string", user({"type": "audio_url", "audio_url": AUDIO_URL})),
    ("input_audio wav", user(_audio("wav"))),
    ("input_audio mp3", user(_audio("mp3"))),
    ("input_audio flac", user(_audio("flac"))),
    ("input_audio WAV", user(_audio("WAV"))),
    ("input_audio format missing", user({"type": "input_audio", "input_audio": {"data": WAV_B64}})),
    ("input_audio string", user({"type": "input_audio", "input_audio": WAV_B64})),
    ("typeless image_url object", user({"image_url": {"url": PNG}})),
    ("typeless video_url object", user({"video_url": {"url": VIDEO_URL}})),
    ("typeless audio_url object", user({"audio_url": {"url": AUDIO_URL}})),
    ("typeless image_url string", user({"image_url": PNG})),
    ("typeless video_url string", user({"video_url": VIDEO_URL})),
    ("typeless audio_url string", user({"audio_url": AUDIO_URL})),
    ("typeless input_audio", user({"input_audio": {"data": WAV_B64, "format": "wav"}})),
    ("typeless image_embeds", user({"image_embeds": TENSOR_B64})),
    ("typeless text", user({"text": "hi"})),
    ("typeless empty part", user({})),
    ("typeless + uuid, image_url object", user({"image_url": {"url": PNG}, "uuid": "u"})),
    ("typeless + uuid, image_url string", user({"image_url": PNG, "uuid": "u"})),
    ("typeless + uuid, video_url object", user({"video_url": {"url": VIDEO_URL}, "uuid": "u"})),
    ("uuid: text type + video_embeds", user({**TEXT, "uuid": "u", "video_embeds": TENSOR_B64})),
    ("uuid: image_url null", user({"type": "image_url", "image_url": None, "uuid": "u"})),
    ("uuid: image_url object", user({**_url("image_url", PNG), "uuid": "u"})),
    ("uuid: typed video_url", user({**_url("video_url", VIDEO_URL), "uuid": "u"})),
    ("uuid: typed audio_url", user({**_url("audio_url", AUDIO_URL), "uuid": "u"})),
    ("uuid: typed input_audio", user({**_audio("wav"), "uuid": "u"})),
    ("uuid: text only", user({**TEXT, "uuid": "u"})),
    ("uuid: image_embeds null", user({"type": "image_embeds", "image_embeds": None, "uuid": "u"})),
    ("uuid int", user({**_url("image_url", PNG), "uuid": 7})),
    ("text + stray video_embeds", user({**TEXT, "video_embeds": TENSOR_B64})),
    ("text + stray image_url", user({**TEXT, "image_url": {"url": PNG}})),
    ("image_url + stray video_url", user({**_url("image_url", PNG), "video_url": VIDEO_URL})),
    ("video_url + stray audio_url", user({**_url("video_url", VIDEO_URL), "audio_url": AUDIO_URL})),
    ("file part", user({"type": "file", "file": {"file_data": TENSOR_B64, "filename": "a.pdf"}})),
    ("file id part", user({"type": "file", "file": {"file_id": "file-1"}})),
    ("input_text", user({"type": "input_text", "text": "hi"})),
    ("output_text", user({"type": "output_text", "text": "hi"})),
    ("refusal part", user({"type": "refusal", "refusal": "no"})),
    ("thinking part", user({"type": "thinking", "thinking": "hmm"})),
    ("tool_reference part", user({"type": "tool_reference", "name": "get_weather"})),
    ("input_image", user({"type": "input_image", "image_url": PNG})),
    ("input_image + detail", user({"type": "input_image", "image_url": PNG, "detail": "auto"})),
    ("input_image file_id", user({"type": "input_image", "file_id": "f", "detail": "auto"})),
    ("input_file", user({"type": "input_file", "file_data": TENSOR_B64, "filename": "a.pdf"})),
    ("detail auto", user(_url("image_url", PNG, detail="auto"))),
    ("detail low", user(_url("image_url", PNG, detail="low"))),
    ("detail high", user(_url("image_url", PNG, detail="high"))),
    ("detail original", user(_url("image_url", PNG, detail="original"))),
    ("detail default", user(_url("image_url", PNG, detail="default"))),
    ("detail bogus", user(_url("image_url", PNG, detail="max"))),
    ("detail null", user(_url("image_url", PNG, detail=None))),
    ("detail on video_url", user(_url("video_url", VIDEO_URL, detail="low"))),
    ("detail at part level", user({**_url("image_url", PNG), "detail": "high"})),
    ("image_embeds", user({"type": "image_embeds", "image_embeds": TENSOR_B64})),
    (
        "image_embeds dict",
        user({"type": "image_embeds", "image_embeds": {"image_embeds": TENSOR_B64}}),
    ),
    ("image_embeds list", user({"type": "image_embeds", "image_embeds": [1, 2]})),
    ("video_embeds", user({"type": "video_embeds", "video_embeds": TENSOR_B64})),
    (
        "video_embeds + audio_embeds",
        user({"type": "video_embeds", "video_embeds": TENSOR_B64, "audio_embeds": TENSOR_B64}),
    ),
    ("audio_embeds", user({"type": "audio_embeds", "audio_embeds": TENSOR_B64})),
    ("prompt_embeds part", user(TEXT, {"type": "prompt_embeds", "data": TENSOR_B64})),
    ("prompt_embeds empty", user({"type": "prompt_embeds", "data": ""})),
    (
        "image + image_embeds",
        user(_url("image_url", PNG), {"type": "image_embeds", "image_embeds": TENSOR_B64}),
    ),
    (
        "use_audio_in_video (mm_processor_kwargs)",
        user(_url("video_url", VIDEO_URL), mm_processor_kwargs={"use_audio_in_video": True}),
    ),
    ("mm_processor_kwargs, image", user(_url("image_url", PNG), mm_processor_kwargs={"x": 1})),
    ("media_io_kwargs", user(TEXT, media_io_kwargs={"video": {"num_frames": 4}})),
    (
        "use_audio_in_video (top level)",
        user(_url("video_url", VIDEO_URL), use_audio_in_video=True),
    ),
    (
        "image in system message",
        {
            "messages": [
                {"role": "system", "content": [_url("image_url", PNG)]},
                {"role": "user", "content": "hi"},
            ]
        },
    ),
    (
        "image in assistant message",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [_url("image_url", PNG)]},
            ]
        },
    ),
    (
        "image in tool message",
        {
            "messages": [
                {"role": "tool", "tool_call_id": "c1", "content": [_url("image_url", PNG)]},
            ]
        },
    ),
    ("image in developer message", {"messages": [{"role": "developer", "content": [TEXT]}]}),
    ("custom role", {"messages": [{"role": "narrator", "content": [_url("image_url", PNG)]}]}),
    ("assistant content null", {"messages": [{"role": "assistant", "content": None}]}),
    ("user content null", {"messages": [{"role": "user", "content": None}]}),
    ("user content empty list", {"messages": [{"role": "user", "content": []}]}),
    ("user content missing", {"messages": [{"role": "user"}]}),
    ("user role capitalised", {"messages": [{"role": "User", "content": "hi"}]}),
    (
        "user role capitalised, image",
        {"messages": [{"role": "User", "content": [_url("image_url", PNG)]}]},
    ),
    ("user role upper, content missing", {"messages": [{"role": "USER"}]}),
    (
        "system role capitalised, content missing",
        {"messages": [{"role": "System"}, {"role": "user", "content": "hi"}]},
    ),
    (
        "assistant role capitalised, image",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "Assistant", "content": [_url("image_url", PNG)]},
            ]
        },
    ),
    ("role missing", {"messages": [{"content": "hi"}]}),
    ("role int", {"messages": [{"role": 1, "content": "hi"}]}),
    ("message not an object", {"messages": ["hi"]}),
    ("content int", {"messages": [{"role": "user", "content": 3}]}),
    ("part int", user(3)),
    ("part null", user(None)),
    ("image_pil", user({"type": "image_pil", "image_pil": TENSOR_B64})),
    ("unknown type", user({"type": "hologram", "hologram": TENSOR_B64})),
    ("type int", user({"type": 1, "text": "x"})),
    ("text null", user({"type": "text", "text": None})),
    ("text int", user({"type": "text", "text": 4})),
    ("empty messages", {"messages": []}),
    ("messages missing", {}),
    ("reasoning string", {"messages": [{"role": "assistant", "content": "a", "reasoning": "r"}]}),
    (
        "reasoning prompt_embeds",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "a",
                    "reasoning": {"type": "prompt_embeds", "data": TENSOR_B64},
                },
            ]
        },
    ),
    ("two images", user(_url("image_url", PNG), _url("image_url", IMAGE_URL))),
    (
        "image + video + audio",
        user(_url("image_url", PNG), _url("video_url", VIDEO_URL), _audio("wav")),
    ),
    ("extra part key", user({**_url("image_url", PNG), "cache_control": {"type": "ephemeral"}})),
    ("extra url key", user(_url("image_url", PNG, mime="image/png"))),
]

# ------------------------------------------------------------------ random bodies

ROLES = ("user", "user", "user", "system", "assistant", "tool", "developer", "narrator")
PART_TYPES = (
    "text",
    "image_url",
    "image_url",
    "video_url",
    "audio_url",
    "input_audio",
    "image_embeds",
    "video_embeds",
    "audio_embeds",
    "prompt_embeds",
    "input_image",
    "input_text",
    "refusal",
    "thinking",
    "file",
    "image_pil",
    "tool_reference",
    "hologram",
    None,  # typeless
)
PAYLOAD_KEYS = {
    "text": "text",
    "input_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
    "tool_reference": "name",
    "prompt_embeds": "data",
    "file": "file",
    "hologram": "hologram",
}
MEDIA_KEYS = (
    "image_url",
    "video_url",
    "audio_url",
    "input_audio",
    "image_embeds",
    "video_embeds",
    "audio_embeds",
)
DETAILS = ("auto", "low", "high", "original", "default", "max", None)
EXTRA_KEYS = ("cache_control", "name", "x_note", "detail")


def _payload(kind: str, rng: random.Random) -> Any:
    """A payload for a part of ``kind``: usually well formed, sometimes not."""
    roll = rng.random()
    if roll < 0.06:
        return None
    if roll < 0.09:
        return rng.choice([3, [], True])
    if kind in ("image_url", "video_url", "audio_url"):
        url = {"image_url": rng.choice([PNG, IMAGE_URL]), "video_url": VIDEO_URL}.get(
            kind, AUDIO_URL
        )
        if rng.random() < 0.25:
            return url  # the string form
        payload: dict[str, Any] = {"url": url}
        if kind == "image_url" and rng.random() < 0.35:
            payload["detail"] = rng.choice(DETAILS)
        return payload
    if kind == "input_audio":
        fmt = rng.choice(["wav", "mp3", "wav", "flac", "WAV", None])
        return {"data": WAV_B64, **({"format": fmt} if fmt is not None else {})}
    if kind.endswith("_embeds") or kind == "prompt_embeds":
        return TENSOR_B64 if rng.random() < 0.8 else {kind: TENSOR_B64}
    if kind == "file":
        return {"file_data": TENSOR_B64, "filename": "a.pdf"}
    if kind == "image_pil":
        return TENSOR_B64
    return rng.choice(["describe", "hello", ""])


def random_part(rng: random.Random) -> Part:
    if rng.random() < 0.05:
        return rng.choice(["bare text", 7, None])
    kind = rng.choice(PART_TYPES)
    if kind is None:  # typeless: the payload key alone says what it is
        key = rng.choice([*MEDIA_KEYS, "text"])
        part: dict[str, Any] = {key: _payload(key, rng)}
    elif kind == "input_image":
        part = {"type": kind, "image_url": rng.choice([PNG, IMAGE_URL])}
        if rng.random() < 0.6:
            part["detail"] = rng.choice(DETAILS)
    else:
        part = {"type": kind, PAYLOAD_KEYS.get(kind, kind): _payload(kind, rng)}
    if rng.random() < 0.2:
        part["uuid"] = rng.choice(["u-1", "u-2", None, 5])
    if rng.random() < 0.15:  # a duplicate media key: another kind's payload in the same part
        extra_key = rng.choice(MEDIA_KEYS)
        part.setdefault(extra_key, _payload(extra_key, rng))
    if rng.random() < 0.15:
        key = rng.choice(EXTRA_KEYS)
        part.setdefault(key, rng.choice(["high", {"type": "ephemeral"}, "x"]))
    return part


def random_message(rng: random.Random) -> dict[str, Any]:
    role = rng.choice(ROLES)
    message: dict[str, Any] = {"role": role}
    roll = rng.random()
    if roll < 0.15:
        message["content"] = "plain text"
    elif roll < 0.19:
        message["content"] = None if rng.random() < 0.7 else []
    else:
        message["content"] = [random_part(rng) for _ in range(rng.randint(1, 3))]
    if role == "tool":
        message["tool_call_id"] = "call-1"
    return message


def random_body(rng: random.Random) -> Body:
    body: Body = {"messages": [random_message(rng) for _ in range(rng.randint(1, 3))]}
    roll = rng.random()
    if roll < 0.05:
        body["mm_processor_kwargs"] = {"use_audio_in_video": True}
    elif roll < 0.08:
        body["use_audio_in_video"] = True
    return body


def build(random_count: int = RANDOM_BODIES, seed: int = SEED) -> list[tuple[str, Body]]:
    """The hand-written cases, then ``random_count`` random bodies from ``seed``."""
    rng = random.Random(seed)
    cases = list(HAND_WRITTEN)
    cases += [(f"random #{i}", random_body(rng)) for i in range(random_count)]
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=RANDOM_BODIES, help="random bodies")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    for label, body in build(args.count, args.seed):
        sys.stdout.write(json.dumps({"label": label, "body": body}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
