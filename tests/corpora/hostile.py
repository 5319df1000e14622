"""Hostile HTTP requests for the gateway, and the checks every answer must pass.

Shared by ``tests/corpora/fuzz_long.py`` (the long run), ``benchmarks/load_mixed.py``
(its media) and ``tests/hardening/test_fuzz_asgi.py`` (the CI budget). Hypothesis-free on
purpose: a seeded ``random.Random`` mutating a corpus of valid and near-valid
bodies makes a million requests in minutes and any one of them is reproduced
from (seed, index) alone, which a shrinking engine cannot do at this rate.

Three parts:

* ``Generator``: corpus bodies (Chat Completions and Responses API, real Pillow
  images as data URLs, every server's part types) mutated structurally (type
  confusion, field swaps, typeless and uuid parts, duplicate keys written as raw
  text, huge numbers, lone surrogates, deep nesting, garbled base64) and then as
  bytes and as HTTP (paths, methods, body headers, chunking).
* ``check_response``: the invariants of one answer: a status, no 5xx the test did
  not cause, the error envelope on every non-2xx, no internals in messages.
* ``upstream_findings``: what the model server behind the gate must never see:
  a media part its model's rule refuses, read the way a lenient server reads it
  (last copy of a duplicate key wins, paths normalised, types inferred from
  payload keys). The recording upstreams (in-process and ``python hostile.py
  upstream``) run it on every request that reaches them.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import posixpath
import random
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from PIL import Image

# The media stubs the tests use (tests/media_stubs.py), one copy for both.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, run as a script
from media_stubs import MP4_BYTES, PDF_BYTES, WAV_BYTES, jpeg_with, png_bomb, png_with_chunks

# ---------------------------------------------------------------- media bytes


def _image(fmt: str, size: tuple[int, int] = (32, 24), color: str = "red", **save: Any) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt, **save)
    return buffer.getvalue()


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "green", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buffer.getvalue()


def _noise_png(side: int, seed: int) -> bytes:
    """Random pixels barely compress: a body big enough for the gate's worker-thread path."""
    image = Image.frombytes("RGB", (side, side), random.Random(seed).randbytes(side * side * 3))
    buffer = io.BytesIO()
    image.save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()


class Media:
    """Real small media, made once per process (Pillow is the slow part of generation)."""

    def __init__(self) -> None:
        self.images: dict[str, tuple[bytes, str]] = {
            "png": (_image("PNG"), "image/png"),
            "jpeg": (_image("JPEG", color="blue"), "image/jpeg"),
            "gif": (_image("GIF", color="green"), "image/gif"),
            "webp": (_image("WEBP", color="yellow"), "image/webp"),
            "png_big_side": (_image("PNG", size=(600, 40)), "image/png"),
        }
        self.hostile: dict[str, tuple[bytes, str]] = {
            "animated_gif": (_animated_gif(), "image/gif"),
            "tiny_png": (_image("PNG", size=(1, 1)), "image/png"),
            "bmp": (_image("BMP", size=(8, 8)), "image/bmp"),
            "tiff": (_image("TIFF", size=(8, 8)), "image/tiff"),
            "bomb": (png_bomb(), "image/png"),
            "wide_bomb": (png_bomb(200_000, 2), "image/png"),
            # Past the walk's entry budget (media/walk_budget.py): empty segments, chunks.
            "padded_jpeg": (jpeg_with(b"\xff\xfe\x00\x02" * 5000), "image/jpeg"),
            "padded_png": (png_with_chunks(5000), "image/png"),
            "mp4": (MP4_BYTES, "video/mp4"),
            "wav": (WAV_BYTES, "audio/wav"),
            "pdf": (PDF_BYTES, "application/pdf"),
            "empty": (b"", "image/png"),
            "text": (b"hello, not an image", "text/plain"),
        }
        self._big: bytes | None = None

    @property
    def big_png(self) -> bytes:
        """~750 KB: over the gate's 256 KiB threshold for validating in a worker thread."""
        if self._big is None:
            self._big = _noise_png(500, 7)
        return self._big

    def data_url(self, name: str) -> str:
        data, mime = self.images.get(name) or self.hostile[name]
        return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# ---------------------------------------------------------------- the request

GATED_CHAT = ("/v1/chat/completions", "/chat/completions")
GATED_RESPONSES = ("/v1/responses", "/responses")
GATED = frozenset(GATED_CHAT + GATED_RESPONSES)
TRICKY_PATHS = (
    "/v1/./chat/completions",
    "//v1/chat/completions",
    "/v1//chat/completions",
    "/v1/x/../chat/completions",
    "/v1/x/%2e%2e/chat/completions",
    "/v1/chat%2Fcompletions",
    "/v1/chat%2fcompletions/",
    "/v1/%63hat/completions",
    "/./v1/chat/completions",
    "/v1/chat/completions/.",
    "/v1/chat/completions/./",
    "/v1/chat/completions%2F",
    "/v1/chat/completions;x=1",
    "/V1/chat/completions",
    "/v1/chat/completions%00",
    "/v1/chat/completions%20",
    "//v1/responses",
    "/v1/./responses",
    "/v1/responses/.",
    "/x/../responses",
    "/v1/responses%2F",
    "/v1/chat/completions?stream=true",
    "/v1/chat/completions/?a=b",
    "/v1/responses?x=%2F..%2F",
)
OTHER_PATHS = (
    "/v1/completions",
    "/tokenize",
    "/v1/tokenize",
    "/v1/embeddings",
    "/generate",
    "/flush_cache",
    "/v1/validate",
    "/v1/validate/responses",
    "/v1/encode",
    "/v1/models",
    "/v1/models/kimi-k3",
    "/healthz",
    "/readyz",
    "/metrics",
    "/",
    "/v1",
    "*",
)
GATED_WEIGHTED = (
    *GATED_CHAT * 6,
    *GATED_RESPONSES * 3,
    "/v1/chat/completions/",
    "/v1/responses/",
)
MODELS = (
    "kimi-k3",
    "kimi-k3",
    "kimi-k3",
    "moonshotai/Kimi-K3-Instruct",
    "kimi-k2.5",
    "qwen2.5-vl",
    "qwen2-audio",
    "gpt-4o",
    "gemma-3-1b",
    "unknown/model",
)
MODEL_MUTANTS = (
    "KIMI-K3",
    "Kimi-K3",
    " kimi-k3",
    "kimi-k3 ",
    "kimi-k3\n",
    "kimi-k3\u0000",
    "kimi-k3\u200b",
    "kimi‐k3",  # a Unicode hyphen
    "kimi-*",
    "*",
    "moonshotai/Kimi-K3",
    "moonshotai/Kimi-K3/../../x",
    "",
    "k" * 5000,
    "kimi-k3" + "\ud800",
)
PART_TYPES = (
    "text",
    "refusal",
    "image_url",
    "input_audio",
    "file",
    "input_text",
    "output_text",
    "input_image",
    "input_file",
    "video_url",
    "audio_url",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "video_embeds",
    "image_pil",
    "thinking",
    "tool_reference",
    "IMAGE_URL",
    "image_url ",
    "video",
    "image",
    "",
)
JUNK_SCALARS: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    2**63,
    2**64,
    -(2**63) - 1,
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "\u0000",
    "\ufeff",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "data:",
    "data:image/png;base64,",
    "https://x.test/a.png",
    "file:///etc/passwd",
    "http://169.254.169.254/latest/meta-data/",
    "0" * 300,
)
# Written verbatim into the serialised body where a sentinel string stands.
RAW_FRAGMENTS: tuple[bytes, ...] = (
    b"123456789012345678901234567890",
    b"-123456789012345678901234567890",
    b"18446744073709551616",
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1.00000000000000000000000000001",
    b"-0",
    b"0e0",
    b'"\\ud800"',
    b'"\\udfff"',
    b'"a\\ud83d"',
    b'"\\udfff\\ud800"',
    b'"\\u0000"',
    b'"\xed\xa0\x80"',
    b'"\xc0\xaf"',
    b'"\xff"',
    b"[" * 200 + b"]" * 200,
    b"[" * 3000 + b"]" * 3000,
    b'{"a":' * 600 + b"1" + b"}" * 600,
    b"[" * 100_000 + b"]" * 100_000,
)
CONTENT_TYPES: tuple[bytes | None, ...] = (
    None,
    b"application/json; charset=utf-8",
    b"APPLICATION/JSON",
    b"application/vnd.api+json",
    b"application/json, text/plain",
    b"text/plain",
    b"text/event-stream",
    b"multipart/form-data; boundary=x",
    b"application/x-www-form-urlencoded",
    b"",
    b" ",
    b"application/json\x00",
    b"application/\xff",
    b"application/json;" + b"a" * 5000,
)
CONTENT_ENCODINGS = (b"gzip", b"br", b"deflate", b"identity", b"", b"GZIP", b"gzip, identity", b"x")
CONTENT_LENGTHS = (
    b"-1",
    b"abc",
    b"99999999999999999999999",
    b"+5",
    b" 5",
    b"0x10",
    b"1_000",
    b"",
    b"1e3",
    b"0",
    b"68719476736",
)
METHODS = ("PUT", "PATCH", "GET", "DELETE", "OPTIONS", "HEAD")
FAULTS = ("connect", "timeout", "status500", "reset")
FAULT_HEADER = b"x-fuzz-fault"
ID_HEADER = b"x-request-id"
UPSTREAM_MARK = (b"x-fuzz-upstream", b"1")  # on every recording upstream's reply


@dataclass
class HostileRequest:
    """One request as it goes on the wire (or into an ASGI scope)."""

    index: int
    method: str
    target: bytes  # raw path and query, as the client sends it
    headers: list[tuple[bytes, bytes]]  # lower-case names; content-length included as sent
    body: bytes
    chunks: list[int] = field(default_factory=list)  # ASGI: body split at these sizes
    fault: str | None = None  # a deliberate upstream failure, for the in-process upstream
    notes: list[str] = field(default_factory=list)  # the mutations applied, for a reader
    stream: bool = False

    @property
    def raw_path(self) -> bytes:
        return self.target.split(b"?", 1)[0]

    @property
    def query(self) -> bytes:
        return self.target.partition(b"?")[2]

    @property
    def request_id(self) -> str:
        return f"fuzz-{self.index}"

    def to_json(self) -> dict[str, Any]:
        """Everything needed to send it again, readable where the bytes allow."""
        out: dict[str, Any] = {
            "index": self.index,
            "method": self.method,
            "target": self.target.decode("latin-1"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.headers],
            "body_b64": base64.b64encode(self.body).decode(),
            "chunks": self.chunks,
            "fault": self.fault,
            "notes": self.notes,
        }
        try:
            text = self.body.decode("utf-8")
            out["body_text"] = text if len(text) <= 20_000 else text[:20_000] + "...[cut]"
        except UnicodeDecodeError:
            pass
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostileRequest:
        return cls(
            index=data.get("index", 0),
            method=data["method"],
            target=data["target"].encode("latin-1"),
            headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in data["headers"]],
            body=base64.b64decode(data["body_b64"]),
            chunks=list(data.get("chunks") or []),
            fault=data.get("fault"),
            notes=list(data.get("notes") or []),
        )


# ---------------------------------------------------------------- the generator

_Node = tuple[Any, Any]  # (container, key or index)


class Generator:
    """Seeded hostile requests: ``request(i)`` is the same request for the same seed and i.

    ``http_safe`` keeps the framing honest (Content-Length right, no deliberate upstream
    faults) for targets reached over a real socket, where a lying header is the HTTP
    server's business and not the gate's.
    """

    def __init__(self, seed: int, media: Media | None = None, http_safe: bool = False) -> None:
        self.seed = seed
        self.media = media or Media()
        self.http_safe = http_safe
        self._urls = {name: self.media.data_url(name) for name in self.media.images}
        self._urls.update({name: self.media.data_url(name) for name in self.media.hostile})

    # -- corpus

    def _image_url(self, rng: random.Random) -> str:
        if rng.random() < 0.85:
            return self._urls[rng.choice(("png", "jpeg", "gif", "webp", "png", "jpeg"))]
        return self._urls[rng.choice(list(self.media.hostile))]

    def _remote_url(self, rng: random.Random) -> str:
        return rng.choice(
            (
                "https://x.test/a.png",
                "http://127.0.0.1/a.png",
                "https://169.254.169.254/latest/meta-data/",
                "https://[::1]/a.png",
                "https://2130706433/a.png",
                "file:///etc/passwd",
                "ftp://x.test/a.png",
                "https://u:p@x.test/a.png",
                "//x.test/a.png",
                "a.png",
            )
        )

    def _part(self, rng: random.Random) -> Any:
        """One content part of any kind a server knows, mostly well formed."""
        kind = rng.choices(
            (
                "text",
                "image",
                "image_obj",
                "input_image",
                "video",
                "audio_url",
                "input_audio",
                "file",
                "input_file",
                "image_embeds",
                "video_embeds",
                "uuid",
                "typeless",
                "remote",
                "bare",
            ),
            (20, 20, 10, 5, 6, 3, 4, 3, 3, 2, 1, 3, 4, 2, 2),
        )[0]
        if kind == "text":
            return {"type": "text", "text": rng.choice(("describe this", "", "x" * 100))}
        if kind == "image":
            return {"type": "image_url", "image_url": {"url": self._image_url(rng)}}
        if kind == "image_obj":
            detail = rng.choice(("auto", "low", "high"))
            return {
                "type": "image_url",
                "image_url": {"url": self._image_url(rng), "detail": detail},
            }
        if kind == "input_image":
            return {"type": "input_image", "image_url": self._image_url(rng), "detail": "auto"}
        if kind == "video":
            url = rng.choice(("https://x.test/v.mp4", self._urls["mp4"]))
            return {"type": "video_url", "video_url": {"url": url}}
        if kind == "audio_url":
            return {"type": "audio_url", "audio_url": {"url": self._urls["wav"]}}
        if kind == "input_audio":
            data = base64.b64encode(WAV_BYTES).decode()
            return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        if kind == "file":
            return {"type": "file", "file": {"file_data": self._urls["pdf"], "filename": "a.pdf"}}
        if kind == "input_file":
            return {"type": "input_file", "file_data": self._urls["pdf"], "filename": "a.pdf"}
        if kind == "image_embeds":
            return {"type": "image_embeds", "image_embeds": "AAAAAAAAAAA="}
        if kind == "video_embeds":
            return {"type": "video_embeds", "video_embeds": "AAAAAAAAAAA="}
        if kind == "uuid":
            key = rng.choice(("image_url", "video_url", "audio_url", "input_audio"))
            part: dict[str, Any] = {"type": key, "uuid": "item-1"}
            if rng.random() < 0.5:
                part[key] = None
            return part
        if kind == "typeless":
            key = rng.choice(("image_url", "video_url", "audio_url", "image_pil", "image_embeds"))
            return {key: {"url": self._image_url(rng) if key == "image_url" else self._urls["mp4"]}}
        if kind == "remote":
            return {"type": "image_url", "image_url": {"url": self._remote_url(rng)}}
        return rng.choice(("bare string part", ""))

    def _content(self, rng: random.Random) -> Any:
        if rng.random() < 0.15:
            return "hello"
        return [self._part(rng) for _ in range(rng.choice((1, 1, 2, 2, 3, 4)))]

    def _chat(self, rng: random.Random) -> dict[str, Any]:
        messages: list[Any] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You are terse."})
        messages.append({"role": "user", "content": self._content(rng)})
        if rng.random() < 0.15:
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "look", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": self._content(rng)},
            ]
        body: dict[str, Any] = {"model": rng.choice(MODELS), "messages": messages}
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.2:
            body["max_tokens"] = rng.choice((16, 0, -1))
        return body

    def _responses(self, rng: random.Random) -> dict[str, Any]:
        items: list[Any] = []
        if rng.random() < 0.2:
            return {"model": rng.choice(MODELS), "input": "hello"}
        parts = []
        for _ in range(rng.choice((1, 2, 3))):
            part = self._part(rng)
            if isinstance(part, dict) and part.get("type") == "text":
                part = {"type": "input_text", "text": part["text"]}
            elif (
                isinstance(part, dict)
                and isinstance(part.get("image_url"), dict)
                and rng.random() < 0.7
            ):
                part = {"type": "input_image", "image_url": part["image_url"]["url"]}
            parts.append(part)
        message: dict[str, Any] = {"role": "user", "content": parts}
        if rng.random() < 0.5:
            message["type"] = "message"
        items.append(message)
        if rng.random() < 0.2:
            items += [
                {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [self._part(rng)],
                },
            ]
        if rng.random() < 0.1:
            url = self._image_url(rng) if rng.random() < 0.7 else self._urls["mp4"]
            items.append(
                {
                    "type": "computer_call_output",
                    "call_id": "c2",
                    "output": {"type": "computer_screenshot", "image_url": url},
                }
            )
        if rng.random() < 0.1:
            # A content part where an item goes: servers differ on what they make of it.
            part = self._part(rng)
            item = part if isinstance(part, dict) else {"type": "input_text", "text": part}
            items = [*items, item] if rng.random() < 0.5 else [item]
        if rng.random() < 0.05:
            kind = rng.choice(("reasoning", "item_reference", "custom", "message "))
            items.append({"type": kind, "role": "user", "content": [self._part(rng)]})
        body: dict[str, Any] = {"model": rng.choice(MODELS), "input": items}
        if rng.random() < 0.2:
            body["stream"] = True
        return body

    # -- structural mutations

    @staticmethod
    def _nodes(value: Any, limit: int = 400) -> list[_Node]:
        """Every (container, key) below ``value``, breadth first, at most ``limit``."""
        out: list[_Node] = []
        queue = [value]
        while queue and len(out) < limit:
            current = queue.pop(0)
            if isinstance(current, dict):
                for key, child in current.items():
                    out.append((current, key))
                    queue.append(child)
            elif isinstance(current, list):
                for index, child in enumerate(current):
                    out.append((current, index))
                    queue.append(child)
        return out

    @staticmethod
    def _parts(body: dict[str, Any]) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        holders = body.get("messages") if "messages" in body else body.get("input")
        if isinstance(holders, list):
            for holder in holders:
                if isinstance(holder, dict):
                    for key in ("content", "output"):
                        content = holder.get(key)
                        if isinstance(content, list):
                            found += [p for p in content if isinstance(p, dict)]
        return found

    def _junk(self, rng: random.Random, raws: list[bytes]) -> Any:
        roll = rng.random()
        if roll < 0.4:
            return rng.choice(JUNK_SCALARS)
        if roll < 0.55:
            return {"url": self._image_url(rng)} if rng.random() < 0.5 else {}
        if roll < 0.7:
            return [rng.choice(JUNK_SCALARS) for _ in range(rng.randint(0, 3))]
        if roll < 0.8:
            return self._part(rng)
        return self._raw(rng, raws, rng.choice(RAW_FRAGMENTS))

    @staticmethod
    def _raw(rng: random.Random, raws: list[bytes], fragment: bytes) -> str:
        raws.append(fragment)
        return f"__RAW_{len(raws) - 1}__"

    def _mutate_tree(
        self, rng: random.Random, body: dict[str, Any], raws: list[bytes], notes: list[str]
    ) -> None:
        op = rng.choices(
            (
                "replace",
                "delete",
                "swap_fields",
                "retype",
                "confuse",
                "repeat",
                "nest",
                "uuid",
                "untype",
                "role",
                "model",
                "content",
                "junk_field",
                "raw",
                "dup_key_part",
                "escaped_key",
                "base64",
                "media_bytes",
                "stream",
            ),
            (10, 6, 6, 8, 6, 3, 3, 4, 4, 3, 6, 3, 3, 6, 5, 2, 8, 6, 2),
        )[0]
        notes.append(op)
        parts = self._parts(body)
        nodes = self._nodes(body)
        if op == "replace" and nodes:
            container, key = rng.choice(nodes)
            container[key] = self._junk(rng, raws)
        elif op == "delete" and nodes:
            container, key = rng.choice(nodes)
            del container[key]
        elif op == "swap_fields" and len(parts) >= 2:
            a, b = rng.sample(parts, 2)
            if a and b:
                ka, kb = rng.choice(list(a)), rng.choice(list(b))
                a[ka], b[kb] = b.get(kb), a.get(ka)
                if rng.random() < 0.5:  # or carry a payload key across
                    b[ka] = a[ka]
        elif op == "retype" and parts:
            rng.choice(parts)["type"] = rng.choice(PART_TYPES)
        elif op == "confuse" and nodes:
            container, key = rng.choice(nodes)
            value = container[key]
            if isinstance(value, str):
                container[key] = rng.choice(({"url": value}, [value], {"text": value}, 7))
            elif isinstance(value, dict):
                container[key] = rng.choice(([value], json.dumps(value), list(value)))
            elif isinstance(value, list):
                container[key] = rng.choice(({"0": value}, json.dumps(value), value[:1]))
            else:
                container[key] = rng.choice(("1", [value], {"value": value}))
        elif op == "repeat" and parts:
            holders = body.get("messages") or body.get("input")
            if isinstance(holders, list) and holders and isinstance(holders[-1], dict):
                content = holders[-1].get("content")
                if isinstance(content, list) and content:
                    holders[-1]["content"] = content * rng.choice((5, 17, 40))
        elif op == "nest" and nodes:
            container, key = rng.choice(nodes)
            value = container[key]
            for _ in range(rng.choice((1, 3, 50, 300))):
                value = rng.choice(([value], {"x": value}))
            container[key] = value
        elif op == "uuid" and parts:
            rng.choice(parts)["uuid"] = rng.choice(("abc", "", 5, None))
        elif op == "untype" and parts:
            rng.choice(parts).pop("type", None)
        elif op == "role":
            holders = body.get("messages") or body.get("input")
            if isinstance(holders, list) and holders and isinstance(holders[-1], dict):
                holders[-1]["role"] = rng.choice(
                    ("system", "assistant", "tool", "developer", "USER", "", 3, None, ["user"])
                )
        elif op == "model":
            body["model"] = rng.choice(
                (*MODEL_MUTANTS, None, 3, ["kimi-k3"], {"name": "kimi-k3"}, True)
            )
        elif op == "content":
            holders = body.get("messages") or body.get("input")
            if isinstance(holders, list) and holders and isinstance(holders[-1], dict):
                holders[-1]["content"] = rng.choice(
                    (None, "", [], {}, 5, self._part(rng), [[self._part(rng)]], [None])
                )
        elif op == "junk_field":
            target = rng.choice([body, *parts]) if parts else body
            target[
                rng.choice(("extra", "image_url", "video_url", "messages", "input", "metadata"))
            ] = self._junk(rng, raws)
        elif op == "raw" and nodes:
            container, key = rng.choice(nodes)
            container[key] = self._raw(rng, raws, rng.choice(RAW_FRAGMENTS))
        elif op == "dup_key_part" and parts:
            self._duplicate_key_part(rng, body, raws)
        elif op == "escaped_key" and parts:
            part = rng.choice(parts)
            smuggled = {"type": "text", "text": "x"}
            part.clear()
            part.update(smuggled)
            fragment = (
                b'{"type":"text","text":"x","typ\\u0065":"video_url","video_url":{"url":'
                + orjson.dumps(self._urls["mp4"])
                + b"}}"
            )
            self._replace_part(body, part, self._raw(rng, raws, fragment))
        elif op == "base64":
            self._garble_data_url(rng, body)
        elif op == "media_bytes":
            self._mutate_media(rng, body)
        elif op == "stream":
            body["stream"] = rng.choice((True, "true", 1, None, {"x": 1}))

    def _replace_part(self, body: dict[str, Any], part: dict[str, Any], value: Any) -> None:
        holders = body.get("messages") if "messages" in body else body.get("input")
        for holder in holders if isinstance(holders, list) else ():
            if isinstance(holder, dict):
                for key in ("content", "output"):
                    content = holder.get(key)
                    if isinstance(content, list):
                        for index, item in enumerate(content):
                            if item is part:
                                content[index] = value
                                return

    def _duplicate_key_part(
        self, rng: random.Random, body: dict[str, Any], raws: list[bytes]
    ) -> None:
        """A part whose ``type`` (or payload) appears twice: which copy counts?"""
        part = rng.choice(self._parts(body))
        mp4 = orjson.dumps(self._urls["mp4"])
        image = orjson.dumps(self._image_url(rng))
        fragment = rng.choice(
            (
                b'{"type":"image_url","type":"video_url","video_url":{"url":'
                + mp4
                + b'},"image_url":{"url":'
                + image
                + b"}}",
                b'{"type":"video_url","type":"image_url","video_url":{"url":'
                + mp4
                + b'},"image_url":{"url":'
                + image
                + b"}}",
                b'{"type":"image_url","image_url":{"url":'
                + image
                + b'},"image_url":{"url":'
                + mp4
                + b"}}",
                b'{"type":"image_url","image_url":{"url":' + image + b',"url":' + mp4 + b"}}",
                b'{"type":"text","text":"x","type":"input_audio","input_audio":{"data":"'
                + base64.b64encode(WAV_BYTES)
                + b'","format":"wav"}}',
            )
        )
        self._replace_part(body, part, self._raw(rng, raws, fragment))

    def _data_url_nodes(self, body: dict[str, Any]) -> list[_Node]:
        return [
            (c, k)
            for c, k in self._nodes(body, limit=200)
            if isinstance(c[k], str) and c[k][:5].lower() == "data:"
        ]

    def _garble_data_url(self, rng: random.Random, body: dict[str, Any]) -> None:
        nodes = self._data_url_nodes(body)
        if not nodes:
            return
        container, key = rng.choice(nodes)
        url: str = container[key]
        head, _, payload = url.partition(",")
        how = rng.choice(
            (
                "cut",
                "pad",
                "unpad",
                "bang",
                "spaces",
                "urlsafe",
                "upper",
                "nobase64",
                "mime",
                "empty",
                "percent",
                "nocomma",
            )
        )
        if how == "cut":
            payload = payload[: rng.randint(0, max(0, len(payload) - 1))]
        elif how == "pad":
            payload += rng.choice(("=", "==", "===", "A=", "=A"))
        elif how == "unpad":
            payload = payload.rstrip("=")
        elif how == "bang":
            at = rng.randint(0, len(payload))
            payload = payload[:at] + rng.choice(("!", "*", "\u00e9", "%", "\x00")) + payload[at:]
        elif how == "spaces":
            payload = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
        elif how == "urlsafe":
            payload = payload.replace("+", "-").replace("/", "_")
        elif how == "upper":
            head = head.upper()
        elif how == "nobase64":
            head = head.replace(";base64", "")
        elif how == "mime":
            head = (
                "data:"
                + rng.choice(
                    ("video/mp4", "audio/wav", "text/plain", "", "image/svg+xml", "image/png;x=y")
                )
                + ";base64"
            )
        elif how == "empty":
            payload = ""
        elif how == "percent":
            payload = urllib.parse.quote(payload[:200])
        else:
            container[key] = head + payload
            return
        container[key] = f"{head},{payload}"

    def _mutate_media(self, rng: random.Random, body: dict[str, Any]) -> None:
        """Flip bytes, cut, or swap the media inside a data URL, then encode it again."""
        nodes = self._data_url_nodes(body)
        if not nodes:
            return
        container, key = rng.choice(nodes)
        head, _, payload = container[key].partition(",")
        try:
            data = bytearray(base64.b64decode(payload, validate=False))
        except ValueError:
            return
        how = rng.choice(("flip", "flip", "cut", "swap", "swap", "big", "append"))
        if how == "flip" and data:
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == "cut" and data:
            del data[rng.randint(1, len(data)) :]
        elif how == "swap":
            data = bytearray(self.media.hostile[rng.choice(list(self.media.hostile))][0])
        elif how == "big" and rng.random() < 0.1:
            data = bytearray(self.media.big_png)
        elif how == "append":
            data += rng.randbytes(rng.randint(1, 64))
        container[key] = f"{head},{base64.b64encode(bytes(data)).decode()}"

    # -- bytes and HTTP

    @staticmethod
    def _serialise(body: Any, raws: list[bytes]) -> bytes:
        try:
            data = orjson.dumps(body)
        except TypeError:  # lone surrogates, or deeper than orjson's 255 levels
            try:
                data = json.dumps(body, separators=(",", ":")).encode()
            except (RecursionError, ValueError):
                data = b'{"model":"kimi-k3","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
        for index, fragment in enumerate(raws):
            data = data.replace(f'"__RAW_{index}__"'.encode(), fragment)
        return data

    def _mutate_bytes(self, rng: random.Random, data: bytes, notes: list[str]) -> bytes:
        op = rng.choice(
            (
                "bom",
                "utf16",
                "utf32",
                "trailing",
                "second_doc",
                "truncate",
                "flip",
                "dup_model",
                "escape_type",
                "nul",
                "surrogate_bytes",
                "nbsp",
                "empty",
                "not_object",
                "whitespace",
            )
        )
        notes.append("bytes:" + op)
        if op == "bom":
            return b"\xef\xbb\xbf" + data
        if op == "utf16":
            try:
                return data.decode("utf-8").encode(rng.choice(("utf-16", "utf-16-le")))
            except UnicodeDecodeError:
                return data
        if op == "utf32":
            try:
                return data.decode("utf-8").encode("utf-32")
            except UnicodeDecodeError:
                return data
        if op == "trailing":
            return data + rng.choice((b"x", b"}", b"\x00", b" \n", b","))
        if op == "second_doc":
            return data + data
        if op == "truncate":
            return data[: rng.randint(0, max(0, len(data) - 1))]
        if op == "flip":
            buffer = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                if buffer:
                    buffer[rng.randrange(len(buffer))] = rng.randrange(256)
            return bytes(buffer)
        if op == "dup_model" and data.startswith(b"{"):
            model = rng.choice((b'"kimi-k2.5"', b'"qwen2.5-vl"', b'"kimi-k3"', b"null", b"1"))
            if rng.random() < 0.5:
                return b'{"model":' + model + b"," + data[1:]
            return data[:-1] + b',"model":' + model + b"}"
        if op == "escape_type":
            return data.replace(b'"video_url"', b'"video\\u005furl"', 1).replace(
                b'"image_url"', b'"\\u0069mage_url"', 1
            )
        if op == "nul":
            at = rng.randint(0, len(data))
            return data[:at] + b"\x00" + data[at:]
        if op == "surrogate_bytes":
            return data.replace(b'"text":"', b'"text":"\xed\xa0\x80', 1)
        if op == "nbsp":
            return data.replace(b",", b",\xc2\xa0", 1)
        if op == "empty":
            return rng.choice((b"", b" ", b"null", b"{}", b"[]", b'""'))
        if op == "not_object":
            return rng.choice(
                (b"[" + data + b"]", b'"' + data[:50].replace(b'"', b"") + b'"', b"1")
            )
        return b" \t\r\n" + data + b"\n\n"

    def request(self, index: int) -> HostileRequest:
        """The ``index``-th request of this seed: the same bytes every time."""
        rng = random.Random(self.seed * 1_000_003 + index)
        notes: list[str] = []
        raws: list[bytes] = []
        target_kind = rng.random()
        if target_kind < 0.8:
            path = rng.choice(GATED_WEIGHTED)
        elif target_kind < 0.92:
            path = rng.choice(TRICKY_PATHS)
            notes.append("path")
        else:
            path = rng.choice(OTHER_PATHS)
            notes.append("path")
        responses_shape = "responses" in path
        if rng.random() < 0.08:
            responses_shape = not responses_shape  # the other API's body on this path
        body = self._responses(rng) if responses_shape else self._chat(rng)
        for _ in range(rng.choices((0, 1, 2, 3, 5), (25, 35, 20, 12, 8))[0]):
            self._mutate_tree(rng, body, raws, notes)
        data = self._serialise(body, raws)
        if rng.random() < 0.08:
            data = self._mutate_bytes(rng, data, notes)
        method = "POST"
        if rng.random() < 0.05:
            method = rng.choice(METHODS)
            notes.append("method")
        headers: list[tuple[bytes, bytes]] = [(ID_HEADER, f"fuzz-{index}".encode())]
        content_type: bytes | None = b"application/json"
        if rng.random() < 0.08:
            content_type = rng.choice(CONTENT_TYPES)
            notes.append("content-type")
        if content_type is not None:
            headers.append((b"content-type", content_type))
            if rng.random() < 0.01:
                headers.append((b"content-type", b"text/plain"))  # a second, disagreeing copy
        if rng.random() < 0.03:
            headers.append((b"content-encoding", rng.choice(CONTENT_ENCODINGS)))
            notes.append("content-encoding")
        length: bytes | None = str(len(data)).encode()
        chunked = self.http_safe and rng.random() < 0.1  # over HTTP: Transfer-Encoding
        roll = 1.0 if chunked else rng.random()
        if not self.http_safe and roll < 0.05:
            length = rng.choice(CONTENT_LENGTHS)
            notes.append("content-length")
        elif not self.http_safe and roll < 0.12:
            length = None
        if length is not None and not chunked:
            headers.append((b"content-length", length))
        elif not self.http_safe:
            # What an ASGI server hands on for a body without a length: it came chunked.
            headers.append((b"transfer-encoding", b"chunked"))
        if rng.random() < 0.02 and not self.http_safe:
            headers.append(
                rng.choice(
                    (
                        (b"accept", b"text/event-stream"),
                        (b"x-http-method-override", b"GET"),
                        (b"transfer-encoding", b"chunked"),
                        (b"expect", b"100-continue"),
                        (b"x-forwarded-for", b"127.0.0.1"),
                        (b"connection", b"content-length"),
                    )
                )
            )
            notes.append("header")
        chunks: list[int] = []
        if (chunked or (not self.http_safe and rng.random() < 0.25)) and data:
            remaining = len(data)
            while remaining > 0:
                size = rng.choice((0, 1, 7, 100, 4096, remaining))
                size = min(size, remaining)
                chunks.append(size)
                remaining -= size
            notes.append("chunked")
        fault = None
        if not self.http_safe and rng.random() < 0.02:
            fault = rng.choice(FAULTS)
            headers.append((FAULT_HEADER, fault.encode()))
        stream = isinstance(body, dict) and body.get("stream") is True
        return HostileRequest(
            index, method, path.encode(), headers, data, chunks, fault, notes, stream
        )


# ---------------------------------------------------------------- the answer's checks


def _catalogue() -> dict[str, int]:
    """The documented codes and their statuses: ``modalgate.errors`` is the list."""
    from modalgate.errors import STATUS

    return {code.value: status for code, status in STATUS.items()}


STATUS_OF = _catalogue()
KNOWN_CODES = frozenset(STATUS_OF)
# What a message must never carry: stack text, reprs, heap addresses, source paths.
INTERNALS = re.compile(
    r"Traceback|object at 0x|\b0x[0-9a-fA-F]{8,}\b|File \"/|\.py\"?, line|"
    r"<(class|module|function|PIL)[ .]|[A-Z][a-zA-Z]+(Error|Exception)\(|site-packages"
)
# A deliberate upstream fault, and the statuses it may cause.
FAULT_STATUSES = {
    "connect": {502},
    "timeout": {504},
    "status500": {500},
    "reset": {200, 502},
}


@dataclass
class Answer:
    """What came back for one request, in either target."""

    status: int | None  # None: no response at all
    headers: list[tuple[bytes, bytes]]
    body: bytes
    problems: list[tuple[str, str]] = field(default_factory=list)  # (class, detail)
    upstream_status: int | None = None  # set when the (recording) upstream answered


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)


def envelope_problem(body: bytes, status: int) -> str | None:
    """Why ``body`` is not modalgate's error envelope for ``status``; None when it is."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"not JSON: {body[:80]!r}"
    error = value.get("error") if isinstance(value, dict) else None
    if not isinstance(error, dict):
        return "no 'error' object"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(error.get("type"), str):
        return "error.type is not a string"
    if error.get("param") is not None and not isinstance(error["param"], str):
        return "error.param is neither a string nor null"
    code = error.get("code")
    if not isinstance(code, str):
        return "error.code is not a string"
    if code not in KNOWN_CODES:
        return f"error.code {code!r} is not a documented code"
    violations = error.get("violations")
    if not isinstance(violations, list) or not violations:
        return "error.violations is not a non-empty list"
    for violation in violations:
        if not isinstance(violation, dict) or not isinstance(violation.get("message"), str):
            return "a violation is not an object with a message"
        if violation.get("code") not in KNOWN_CODES:
            return f"a violation's code {violation.get('code')!r} is not documented"
    if violations[0].get("code") != code or violations[0].get("message") != error["message"]:
        return "the first violation does not fill code/message"
    messages = [error["message"], *(v["message"] for v in violations)]
    for message in messages:
        if INTERNALS.search(message):
            return f"internals in a message: {message[:200]!r}"
    return None


def error_code(body: bytes) -> str | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        code = value["error"].get("code")
        return code if isinstance(code, str) else repr(code)
    return None


def check_answer(request: HostileRequest, answer: Answer) -> None:
    """Append the broken invariants of one answer to ``answer.problems``."""
    status = answer.status
    if status is None:
        return  # the target recorded why (no response, hang, crash)
    if request.fault is not None:
        allowed = FAULT_STATUSES[request.fault]
        if status in allowed or (status < 500 and answer.upstream_status is None):
            return  # the fault caused it, or the gate refused before the upstream
    if status >= 500:
        answer.problems.append(("5xx", f"status {status}: {answer.body[:200]!r}"))
    from_upstream = answer.upstream_status is not None and answer.upstream_status == status
    if not 200 <= status < 300 and not from_upstream and request.method.strip().upper() != "HEAD":
        problem = envelope_problem(answer.body, status)
        if problem is None:
            expected = STATUS_OF.get(error_code(answer.body) or "")
            if expected is not None and expected != status:
                problem = f"status {status} but code {error_code(answer.body)} says {expected}"
        if problem is not None:
            answer.problems.append(("envelope", f"status {status}: {problem}"))


# ---------------------------------------------------------------- what the upstream must not see

MEDIA_MODALITY = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
    "file": "file",
    "input_file": "file",
    "image_embeds": "embeddings",
    "audio_embeds": "embeddings",
    "prompt_embeds": "embeddings",
    "video_embeds": "embeddings",
}
_SNIFFED = (
    (b"ftyp", 4, "video"),
    (b"RIFF", 0, None),  # WAVE or WEBP: told apart below
    (b"ID3", 0, "audio"),
    (b"OggS", 0, "audio"),
    (b"fLaC", 0, "audio"),
    (b"%PDF", 0, "file"),
    (b"\x1aE\xdf\xa3", 0, "video"),
)
_OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})


def normalise_path(raw_path: bytes) -> str:
    """The path a lenient server or a proxy in front of it (nginx's defaults) would route:
    percent-decoded, slashes merged, dot segments resolved, trailing slash dropped.
    (``;params`` are kept: only Java servlet containers strip them.)"""
    text = urllib.parse.unquote(raw_path.decode("latin-1"))
    text = re.sub(r"/{2,}", "/", text)
    if not text.startswith("/"):
        text = "/" + text
    text = posixpath.normpath(text)
    return text.rstrip("/") or "/"


def _sniffed(url: str) -> str | None:
    """The modality the bytes of a data URL declare, when it is not an image."""
    head, _, payload = url.partition(",")
    mime = head[5:].split(";", 1)[0].strip().lower()
    if mime.startswith(("video/", "audio/")):
        return mime.split("/", 1)[0]
    if mime == "application/pdf":
        return "file"
    try:
        data = base64.b64decode(payload[:64] + "=" * (-len(payload[:64]) % 4), validate=False)
    except ValueError:
        return None
    for magic, offset, modality in _SNIFFED:
        if data[offset : offset + len(magic)] == magic:
            if magic == b"RIFF":
                return "audio" if data[8:12] == b"WAVE" else None
            return modality
    return None


def _url_of(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("url"), str):
        return value["url"]
    return None


def _plausible(key: str, value: Any) -> bool:
    """A payload a server would try to load (a malformed one it refuses on its own)."""
    if isinstance(value, str):
        return bool(value) and key not in ("file", "input_audio")
    if not isinstance(value, dict):
        return False
    wanted = {"file": ("file_data", "file_id"), "input_audio": ("data",)}.get(key, ("url",))
    if key.endswith("_embeds"):
        return any(isinstance(v, str) and v for v in value.values())
    return any(isinstance(value.get(name), str) and value[name] for name in wanted)


_PAYLOAD_KEYS = {
    "input_file": ("file_data", "file_url", "file_id"),
    "input_image": ("image_url", "file_id"),
}


def part_modalities(part: Any) -> set[str]:
    """Every media modality some server could read from this part: the declared type's
    (with a loadable payload, or a uuid naming a cached item), every payload key's (vLLM
    infers a missing type, and ignores it next to a uuid), and what an image slot's
    bytes really are."""
    if not isinstance(part, dict):
        return set()
    found: set[str] = set()
    declared = part.get("type")
    if isinstance(declared, str) and declared in MEDIA_MODALITY:
        keys = _PAYLOAD_KEYS.get(declared, (declared,))
        if "uuid" in part or any(_plausible(key, part.get(key)) for key in keys):
            found.add(MEDIA_MODALITY[declared])
    for key, modality in MEDIA_MODALITY.items():
        if key not in _PAYLOAD_KEYS and _plausible(key, part.get(key)):
            found.add(modality)
    if "image" in found:
        for value in (part.get("image_url"), part.get("image_pil")):
            url = _url_of(value)
            if url is not None and url[:5].lower() == "data:":
                sniffed = _sniffed(url)
                if sniffed is not None:
                    found.add(sniffed)
    return found


def _message_parts(message: dict[str, Any]) -> Iterator[Any]:
    content = message.get("content")
    if isinstance(content, list):
        yield from content
    elif isinstance(content, dict):
        yield content
    for key in ("reasoning", "reasoning_content"):
        if isinstance(message.get(key), list):
            yield from message[key]


def _parts_of(body: dict[str, Any], api: str | None) -> Iterator[Any]:
    """The parts a server reads: chat messages' content (``api`` "chat"); Responses items
    with a role as messages, tool outputs, computer-use screenshots, and part-shaped
    items (``api`` "responses"); both for an endpoint of neither API."""
    messages = body.get("messages")
    if isinstance(messages, list) and api != "responses":
        for message in messages:
            if isinstance(message, dict):
                yield from _message_parts(message)
    items = body.get("input")
    if isinstance(items, list) and api != "chat":
        for item in items:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if not isinstance(kind, str):
                continue
            if kind == "message" or "role" in item:
                yield from _message_parts(item)
            elif kind in _OUTPUT_ITEMS and isinstance(item.get("output"), list):
                yield from item["output"]
            elif kind == "computer_call_output" and isinstance(item.get("output"), dict):
                yield {**item["output"], "type": "input_image"}
            elif kind in MEDIA_MODALITY:
                yield item


def _lenient_parse(body: bytes) -> Any:
    """Python's ``json``, as the engines read bodies: BOM and UTF-16/32 detected, NaN taken,
    the last copy of a duplicate key kept."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


@dataclass
class Finding:
    kind: str  # bypass | bypass_path | ungated_media
    detail: str


Resolver = Callable[[str], "tuple[bool, frozenset[str]] | None"]


def upstream_findings(
    method: str, raw_path: bytes, body: bytes, resolve: Resolver, refuses_unknown: bool
) -> list[Finding]:
    """Media the gate let through that the model's rule refuses.

    ``resolve(model)`` gives (known, accepted modalities) from the gate's own policy and
    mode; None when the name is not a string. A finding on a gated path as sent is a
    ``bypass``; on a path only a normalising server routes there, a ``bypass_path``;
    anywhere else (other methods and endpoints, which the gate does not read by
    design) it is ``ungated_media``, reported but not a failure.
    """
    if not body or b"{" not in body[:16]:
        return []
    value = _lenient_parse(body)
    if not isinstance(value, dict):
        return []
    model = value.get("model")
    if not isinstance(model, str):
        return []
    resolved = resolve(model)
    if resolved is None:
        return []
    known, accepts = resolved
    routed = normalise_path(raw_path)
    api = "chat" if routed in GATED_CHAT else "responses" if routed in GATED_RESPONSES else None
    present: set[str] = set()
    for part in _parts_of(value, api):
        present |= part_modalities(part)
    # An unknown model the mode refuses should never have been forwarded with media.
    refused = (present - accepts) if known else (present if refuses_unknown else set())
    if not refused:
        return []
    as_sent = urllib.parse.unquote(raw_path.decode("latin-1")).rstrip("/") or "/"
    detail = (
        f"{method} {raw_path.decode('latin-1')[:80]} model={model[:60]!r} got {sorted(refused)}"
    )
    if method.upper() != "POST" or routed not in GATED:
        return [Finding("ungated_media", detail)]
    if as_sent in GATED:
        return [Finding("bypass", detail)]
    return [Finding("bypass_path", detail)]


def policy_resolver(
    mode: str | None, served: str | None = None, policy: Any = None
) -> tuple[Resolver, bool]:
    """The gate's own policy, as ``upstream_findings`` wants it.

    ``served``: the one model the upstream serves. Such a server (SGLang, an encoder)
    answers with it whatever name a request carries, so what reaches it is judged as
    that model: a video must never reach a Kimi-K3 encoder, whichever name it came with.
    """
    from modalgate.policy import RuleMatcher, load_policy

    matcher = RuleMatcher(policy if policy is not None else load_policy(), mode)

    def resolve(model: str) -> tuple[bool, frozenset[str]] | None:
        rule = matcher.resolve(served or model)
        return rule.known, frozenset(rule.accepts)

    return resolve, bool(matcher.refuses_unknown)


def models_list(served: str | None) -> bytes:
    """``GET /v1/models`` of a recording upstream: its one model, or none listed."""
    data = [{"id": served, "object": "model", "owned_by": "fuzz"}] if served else []
    return orjson.dumps({"object": "list", "data": data})


# ---------------------------------------------------------------- a recording upstream process


def _completion(model: str) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-fuzz",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
        }
    )


def sse_chunks(model: str, tokens: int = 3) -> list[bytes]:
    chunk = {
        "id": "chatcmpl-fuzz",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": "t "}, "finish_reason": None}],
    }
    return [b"data: " + orjson.dumps(chunk) + b"\n\n" for _ in range(tokens)] + [
        b"data: [DONE]\n\n"
    ]


def upstream_reply(body: bytes) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """What the recording upstreams answer: SSE for ``"stream": true``, else one JSON."""
    try:
        value = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        value = None
    model = value.get("model") if isinstance(value, dict) else None
    model = model if isinstance(model, str) else "?"
    if isinstance(value, dict) and value.get("stream") is True:
        return 200, [(b"content-type", b"text/event-stream"), UPSTREAM_MARK], sse_chunks(model[:40])
    payload = _completion(model[:40])
    return (
        200,
        [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            UPSTREAM_MARK,
        ],
        [payload],
    )


class RecordingUpstream:
    """A catch-all ASGI model server: answers every path, checks what it received.

    Run as its own process for the through-serve target (``python hostile.py
    upstream --port P --mode encoder --served kimi-k3``); ``GET /_fuzz/findings``
    returns the findings and the count of requests seen.
    """

    def __init__(self, mode: str | None, served: str | None = None) -> None:
        self.served = served
        self.resolve, self.refuses_unknown = policy_resolver(mode, served)
        self.findings: list[dict[str, Any]] = []
        self.seen = 0
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if body is None:
            return
        headers = dict(scope["headers"])
        if scope["path"] == "/v1/models" and scope["method"] == "GET":
            await _send_simple(send, 200, models_list(self.served))
            return
        if scope["path"] == "/_fuzz/findings":
            with self.lock:
                payload = orjson.dumps({"seen": self.seen, "findings": self.findings})
            await _send_simple(send, 200, payload)
            return
        raw_path = scope.get("raw_path") or scope["path"].encode()
        with self.lock:
            self.seen += 1
        for finding in upstream_findings(
            scope["method"], raw_path, body, self.resolve, self.refuses_unknown
        ):
            with self.lock:
                self.findings.append(
                    {
                        "kind": finding.kind,
                        "detail": finding.detail,
                        "request_id": headers.get(ID_HEADER, b"").decode("latin-1"),
                    }
                )
        if headers.get(FAULT_HEADER) == b"status500":
            await _send_simple(send, 500, b'{"detail":"deliberate"}', [UPSTREAM_MARK])
            return
        status, reply_headers, parts = upstream_reply(body)
        await send({"type": "http.response.start", "status": status, "headers": reply_headers})
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            await send({"type": "http.response.body", "body": part, "more_body": not last})


async def _send_simple(
    send: Any, status: int, payload: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(extra or [])],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    parser = argparse.ArgumentParser(description="the fuzz harness's recording upstream")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upstream")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--mode", default=None)
    up.add_argument("--served", default=None, help="the one model this upstream serves")
    show = sub.add_parser("show", help="print request INDEX of SEED")
    show.add_argument("seed", type=int)
    show.add_argument("index", type=int)
    args = parser.parse_args()
    if args.command == "show":
        print(json.dumps(Generator(args.seed).request(args.index).to_json(), indent=1))
        return
    import uvicorn

    uvicorn.run(
        RecordingUpstream(args.mode or None, args.served or None),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


async def read_body(receive: Any) -> bytes | None:
    """An ASGI request's whole body; None if the client went away first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


if __name__ == "__main__":
    main()
