"""docs/errors.md held to the code: every example envelope is one the code really produces.

The error codes are a public contract and docs/errors.md is where clients read it, so
its examples must not drift from what modalgate answers (four had, silently). Each
``### `code``` section's ```json examples are paired, in order, with a request held
here (``EXAMPLES``); the request goes through the real code (the validator in process,
or the real gateway app under uvicorn in front of a real upstream, media server or
encoder adapter), and the produced envelope must equal the documented one exactly.
To change an example, change the request here and paste what the test reports.

Every code is produced for real; none is checked by shape only. The one documented
message that is not produced is named in ``UNPRODUCED`` with the reason.

The rest of the page is held too: the summary table (status and ``type`` of every
code), each section's status, the messages quoted in the prose, the list of part
types, and every relative link (file and ``#anchor``) in docs/*.md and README.md.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from av_media import make_audio, make_video
from PIL import Image

from conftest import (
    MP4_BYTES,
    REPO_ROOT,
    WAV_BYTES,
    Recorder,
    animated_gif,
    b64,
    chat,
    data_url,
    free_port,
    image_bytes,
    image_part,
    parse_url,
    png_bomb,
    send_body,
    serve,
    start_server,
)
from modalgate.encoder_adapter import BatchSettings
from modalgate.encoder_adapter.towers.local_adapter import LocalImageAdapter, Output
from modalgate.errors import STATUS, ErrorCode, error_body, error_type, status_of
from modalgate.gateway.app import create_app
from modalgate.gateway.http.protocol import ServeHttpProtocol
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.settings import GatewaySettings
from modalgate.validators import validate_body
from modalgate.validators.parts import PART_KINDS
from toy_upstream import Behaviour, ToyUpstream

ROOT = REPO_ROOT
ERRORS_MD = ROOT / "docs" / "errors.md"
LINKED_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# ---------------------------------------------------------------- reading the page


def code_sections(text: str) -> dict[str, str]:
    """Each ``### `code``` section's text, up to the next heading of level 2 or 3."""
    pattern = r"^### `([a-z0-9_]+)`\n(.*?)(?=^#{2,3} |\Z)"
    return {m.group(1): m.group(2) for m in re.finditer(pattern, text, re.M | re.S)}


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def json_examples(text: str) -> list[dict[str, Any]]:
    return [json.loads(block) for block in fenced(text, "json")]


def flat(text: str) -> str:
    """Prose with its line breaks undone, so a quoted message may wrap."""
    return re.sub(r"\s+", " ", text)


DOC = ERRORS_MD.read_text("utf-8")
SECTIONS = code_sections(DOC)
ENVELOPE_SECTION = DOC.split("## The envelope", 1)[1].split("\n## ", 1)[0]

# ---------------------------------------------------------------- producing envelopes


@dataclass(frozen=True)
class Produced:
    """What the code answered: the status, the envelope and the response headers."""

    status: int
    envelope: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


class FailingEncoder(LocalImageAdapter):
    """The real local-adapter pipeline (cache, decode pool, micro-batcher, failure
    isolation) around a model that fails on every image but the warmup one: the
    encoder codes without a checkpoint."""

    name = "failing"

    def __init__(self, batch: BatchSettings | None = None) -> None:
        super().__init__(settings_key="failing", batch=batch)

    def _forward(self, images: list[Image.Image]) -> list[Output | BaseException]:
        if all(image.size == self.warmup_size for image in images):
            return [(None, (1, 1, 1)) for _ in images]
        raise RuntimeError("the model fell over")

    def _patches(self, image: Image.Image) -> int:
        return 1


MEDIA_POLICY = """
extends: builtin
media_urls:
  schemes: [data, https, http]
  allow_private: ["127.0.0.1/32"]
  fetch_timeout_s: 0.5
"""
BUDGET_POLICY = """
extends: builtin
limits: {max_image_tokens: 4096, max_request_image_tokens: 8192}
"""
QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"
TEXT = {"type": "text", "text": "what is in this picture?"}
# vLLM's reference to media cached under a client's id: a uuid, no payload.
REFERENCE = {"type": "image_url", "image_url": None, "uuid": "photo-1"}
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": b64(WAV_BYTES), "format": "wav"}}


def _redirect_to_itself(handler: Any) -> None:
    handler.send_response(302)
    handler.send_header("location", "/loop")
    handler.send_header("content-length", "0")
    handler.end_headers()


def _slow(handler: Any) -> None:
    time.sleep(1)  # past the policy's 0.5 s fetch timeout
    send_body(handler, image_bytes())


def _huge(handler: Any) -> None:
    handler.send_response(200)
    handler.send_header("content-type", "image/png")
    handler.send_header("content-length", str(32 * 1024 * 1024 + 1))
    handler.end_headers()


class Lab:
    """The servers the examples need, each started on first use and stopped at the end,
    so running one example starts only what it needs."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self._urls: dict[str, str] = {}

    def validate(
        self,
        request: dict[str, Any] | bytes,
        *,
        policy: str | None = None,
        mode: str | None = None,
    ) -> Produced:
        """The validator in process, as the gateway and ``modalgate validate`` call it."""
        raw = request if isinstance(request, bytes) else orjson.dumps(request)
        loaded = parse_policy(policy, fmt="yaml") if policy else load_policy()
        verdict = validate_body(raw, RuleMatcher(loaded, mode))
        assert verdict.violations, "the validator accepted the request"
        return Produced(status_of(verdict.violations), error_body(verdict.violations))

    def url(self, name: str) -> str:
        """A gateway's base URL (see ``_start``)."""
        if name not in self._urls:
            self._urls[name] = self._start(name)
        return self._urls[name]

    def media(self) -> str:
        if "media" not in self._urls:
            routes = {
                "/page.html": lambda h: send_body(h, b"<html></html>", "text/html"),
                "/loop": _redirect_to_itself,
                "/slow.png": _slow,
                "/huge.png": _huge,
            }
            server = start_server(Recorder(("127.0.0.1", 0), routes))
            self.stack.callback(server.shutdown)
            self._urls["media"] = server.base
        return self._urls["media"]

    def _start(self, name: str) -> str:
        if name == "plain":  # the built-in policy, no upstream: a validation service
            app = create_app(policy=None)
        elif name == "fetching":  # remote media from the loopback media server
            app = create_app(policy=parse_policy(MEDIA_POLICY, fmt="yaml"))
        elif name == "routed":  # a rule with its own upstream, and no default upstream
            upstream = f"http://127.0.0.1:{free_port()}"
            policy = f"models: [{{name: routed, accepts: [image], upstream: '{upstream}'}}]"
            app = create_app(policy=parse_policy(policy, fmt="yaml"))
        elif name == "dead":  # nothing listens on the upstream's port
            app = create_app(policy=None, upstream=f"http://127.0.0.1:{free_port()}")
        elif name == "silent":  # the upstream takes connections and never answers
            listener = self.stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            upstream = f"http://127.0.0.1:{listener.getsockname()[1]}"
            settings = GatewaySettings(upstream=upstream, upstream_read_timeout_s=1)
            app = create_app(settings=settings)
        elif name == "resetting":  # the upstream dies after two tokens of a stream
            toy = ToyUpstream(behaviour=Behaviour(tokens=5, reset_after=2))
            app = create_app(policy=None, upstream=self.stack.enter_context(serve(toy.app())))
        elif name == "stripping":  # media ids dropped, references refused
            policy = "extends: builtin\nmedia_ids: {mode: strip}"
            app = create_app(policy=parse_policy(policy, fmt="yaml"))
        elif name == "refusing":  # media ids refused, as behind Envoy's ext_authz
            policy = "extends: builtin\nmedia_ids: {mode: refuse}"
            app = create_app(policy=parse_policy(policy, fmt="yaml"))
        elif name == "locked":  # a validation service that asks for a bearer key
            app = create_app(settings=GatewaySettings(api_keys="right-key"))
        elif name == "encoder":
            app = create_app(policy=None, mode="encoder", encoder=FailingEncoder())
        elif name == "encoder-full":  # a queue of size 0 is always full
            encoder = FailingEncoder(BatchSettings(max_queue=0))
            app = create_app(policy=None, mode="encoder", encoder=encoder)
        elif name == "impatient":  # serve's protocol: a 1 s client timeout, 2 KiB heads
            protocol = partial(ServeHttpProtocol, read_timeout_s=1, max_header_bytes=2048)
            return self.stack.enter_context(serve(create_app(policy=None), http=protocol))
        else:
            raise KeyError(name)
        return self.stack.enter_context(serve(app))

    def send(
        self, name: str, method: str, where: str, body: Any = None, **headers: str
    ) -> Produced:
        content = None if body is None else orjson.dumps(body)
        if content is not None:
            headers = {"content-type": "application/json", **headers}
        response = httpx.request(
            method, self.url(name) + where, content=content, headers=headers, timeout=20
        )
        return Produced(response.status_code, response.json(), dict(response.headers))

    def declare_length(self, name: str, where: str, length: int) -> Produced:
        """POST headers that declare a body of ``length`` bytes, and no body: the gate must
        answer from the headers alone."""
        host, port = parse_url(self.url(name))
        connection = http.client.HTTPConnection(host, port, timeout=10)
        try:
            connection.putrequest("POST", where)
            connection.putheader("content-type", "application/json")
            connection.putheader("content-length", str(length))
            connection.endheaders()
            response = connection.getresponse()
            return Produced(response.status, json.loads(response.read()), dict(response.headers))
        finally:
            connection.close()

    def stall(self, name: str, where: str) -> Produced:
        """POST headers and part of the body they declare, then nothing more."""
        head = f"POST {where} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        return self._raw(name, head.encode() + b'content-length: 100\r\n\r\n{"model":')

    def oversized_head(self, name: str, where: str) -> Produced:
        """A request whose headers go on past the server's limit."""
        return self._raw(name, f"POST {where} HTTP/1.1\r\nhost: t\r\nx-pad: {'a' * 4096}".encode())

    def two_lengths(self, name: str, where: str) -> Produced:
        """A request with two Content-Length headers: not HTTP/1.1 (request smuggling)."""
        head = f"POST {where} HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n"
        return self._raw(name, head.encode() + b"content-length: 3\r\n\r\n{}")

    def _raw(self, name: str, sent: bytes) -> Produced:
        """What the server answers to ``sent`` before it closes the connection."""
        with socket.create_connection(parse_url(self.url(name)), timeout=10) as sock:
            sock.sendall(sent)
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        return Produced(int(lines[0].split()[1]), json.loads(body), headers)

    def last_stream_event(self, name: str, request: dict[str, Any]) -> Produced:
        """The last SSE event of a streamed completion (an error once the stream started)."""
        url = self.url(name) + "/v1/chat/completions"
        with httpx.stream("POST", url, json=request, timeout=20) as response:
            events = [
                line.removeprefix("data: ")
                for line in response.iter_lines()
                if line.startswith("data: ")
            ]
            return Produced(response.status_code, json.loads(events[-1]), dict(response.headers))


QWEN_VL = "Qwen/Qwen2.5-VL-7B-Instruct"


def video_part(data: bytes, mime: str = "video/mp4") -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def audio_part(data: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with contextlib.ExitStack() as stack:
        yield Lab(stack)


Producer = Callable[[Lab], Produced]

# The requests behind the examples, per code, in the page's order.
EXAMPLES: dict[str, list[Producer]] = {
    "invalid_json": [
        lambda lab: lab.validate(b'{"model": "kimi-k3", "messages": [}'),
    ],
    "invalid_request": [
        lambda lab: lab.validate(chat({"type": "image_url", "image_url": {}})),
    ],
    "unsupported_content_type": [
        lambda lab: lab.validate(chat({"type": "image_file", "image_file": {"file_id": "f"}})),
    ],
    "unsupported_modality": [
        lambda lab: lab.validate(chat(TEXT, VIDEO), mode="encoder"),
        lambda lab: lab.validate(chat(AUDIO, model="google/gemma-3-27b-it")),
        lambda lab: lab.validate(
            chat(AUDIO, VIDEO, image_part("https://example.com/a.png")), mode="encoder"
        ),
    ],
    "modality_mismatch": [
        lambda lab: lab.validate(chat(image_part(data_url(MP4_BYTES, "image/png")))),
    ],
    "role_not_allowed": [
        lambda lab: lab.validate(chat(image_part("https://example.com/a.png"), role="system")),
    ],
    "unknown_model": [
        lambda lab: lab.validate(chat(model="my-private-model"), policy="unknown_models: reject"),
    ],
    "too_many_media": [
        lambda lab: lab.validate(chat(*[image_part("https://example.com/a.png")] * 17)),
    ],
    "payload_too_large": [
        lambda lab: lab.declare_length("plain", "/v1/chat/completions", 64 * 1024 * 1024 + 1),
    ],
    "invalid_base64": [
        lambda lab: lab.validate(chat(image_part("data:image/png;base64,iVBORw0KGgo"))),
    ],
    "invalid_image": [
        lambda lab: lab.validate(chat(image_part(data_url(image_bytes()[:40])))),
    ],
    "unsupported_image_format": [
        lambda lab: lab.validate(chat(image_part(data_url(image_bytes("BMP"), "image/bmp")))),
    ],
    "animated_image": [
        lambda lab: lab.validate(chat(image_part(data_url(animated_gif(), "image/gif")))),
    ],
    "image_too_large": [
        lambda lab: lab.validate(chat(image_part(data_url(png_bomb(100_000, 100_000))))),
    ],
    "image_too_small": [
        lambda lab: lab.validate(chat(image_part(data_url(image_bytes(size=(1, 1)))))),
    ],
    "unsupported_image_shape": [
        lambda lab: lab.validate(
            chat(TEXT, image_part(data_url(image_bytes(size=(6000, 29)))), model=QWEN)
        ),
    ],
    "invalid_media": [
        lambda lab: lab.validate(chat(video_part(make_video("mp4")[:-100]), model=QWEN_VL)),
    ],
    "unsupported_media_format": [
        lambda lab: lab.validate(chat(video_part(make_video("ts"), "video/mp2t"), model=QWEN_VL)),
    ],
    "media_too_large": [
        lambda lab: lab.validate(
            chat(audio_part(make_audio("wav")), model="Qwen/Qwen2.5-Omni-7B"),
            policy="extends: builtin\nlimits: {max_audio_seconds: 0.5}\n",
        ),
    ],
    "media_too_small": [
        lambda lab: lab.validate(
            chat(video_part(make_video("mp4", frames=1)), model="Qwen/Qwen3-VL-8B-Instruct")
        ),
        lambda lab: lab.validate(
            chat(audio_part(make_audio("wav", seconds=0.01)), model="Qwen/Qwen3-Omni-30B-A3B")
        ),
    ],
    "too_many_image_tokens": [
        lambda lab: lab.validate(
            chat(TEXT, image_part(data_url(image_bytes(size=(3000, 2000)))), model=QWEN),
            policy=BUDGET_POLICY,
        ),
        lambda lab: lab.validate(
            chat(*[image_part(data_url(image_bytes(size=(1800, 1800))))] * 3, model=QWEN),
            policy=BUDGET_POLICY,
        ),
    ],
    "url_not_allowed": [
        lambda lab: lab.validate(chat(image_part("https://169.254.169.254/latest/cat.png"))),
    ],
    "media_fetch_failed": [
        # .invalid never resolves (RFC 6761); a machine whose resolver cannot say so
        # within the 5 s fetch timeout would answer "fetching the URL timed out".
        lambda lab: lab.send(
            "plain",
            "POST",
            "/v1/chat/completions",
            chat(TEXT, image_part("https://nonexistent.invalid/cat.png")),
        ),
    ],
    "unknown_media_id": [
        lambda lab: lab.send("plain", "POST", "/v1/chat/completions", chat(TEXT, REFERENCE)),
    ],
    "media_id_not_allowed": [
        lambda lab: lab.send("stripping", "POST", "/v1/chat/completions", chat(TEXT, REFERENCE)),
    ],
    "encoder_overloaded": [
        lambda lab: lab.send(
            "encoder-full", "POST", "/v1/encode", chat(TEXT, image_part(data_url(image_bytes())))
        ),
    ],
    "encoder_error": [
        lambda lab: lab.send(
            "encoder", "POST", "/v1/encode", chat(TEXT, image_part(data_url(image_bytes())))
        ),
    ],
    "upstream_unavailable": [
        lambda lab: lab.send("dead", "POST", "/v1/chat/completions", chat()),
    ],
    "upstream_timeout": [
        lambda lab: lab.send("silent", "POST", "/v1/chat/completions", chat()),
    ],
    "not_found": [
        lambda lab: lab.send("routed", "GET", "/v1/embeddings"),
    ],
    "method_not_allowed": [
        lambda lab: lab.send("plain", "PUT", "/v1/chat/completions", chat()),
    ],
    "invalid_api_key": [
        lambda lab: lab.send("locked", "POST", "/v1/chat/completions", chat()),
    ],
    "request_timeout": [
        lambda lab: lab.stall("impatient", "/v1/chat/completions"),
    ],
    "headers_too_large": [
        lambda lab: lab.oversized_head("impatient", "/v1/chat/completions"),
    ],
}

# Messages quoted in a section's prose ("Other messages: ..."), each with a request that
# produces it. The envelope's message may put the param in front.
MESSAGES: list[tuple[str, str, Producer]] = [
    ("invalid_json", "the request body is empty", lambda lab: lab.validate(b"")),
    ("invalid_json", "the request body is not valid UTF-8", lambda lab: lab.validate(b"\xff")),
    (
        "invalid_json",
        "the request body is nested too deeply",
        lambda lab: lab.validate(b"[" * 5000 + b"]" * 5000),
    ),
    ("invalid_json", "the request body must be a JSON object", lambda lab: lab.validate(b"[]")),
    (
        "invalid_json",
        "the request body repeats the key 'model' in one object (line 1, column 28); "
        "servers disagree on which copy counts, so send each key once",
        lambda lab: lab.validate(b'{"model": "gpt-4", "model": "x"}'),
    ),
    (
        "invalid_request",
        "the request is not valid HTTP/1.1: Duplicate Content-Length",
        lambda lab: lab.two_lengths("impatient", "/v1/chat/completions"),
    ),
    (
        "invalid_request",
        "model: 'model' is required",
        lambda lab: lab.validate({"messages": [{"role": "user", "content": "hi"}]}),
    ),
    (
        "unknown_model",
        "model: no upstream serves 'x' here (no route for it and no default)",
        lambda lab: lab.send("routed", "POST", "/v1/chat/completions", chat(model="x")),
    ),
    (
        "media_fetch_failed",
        "fetching the URL timed out",
        lambda lab: lab.send(
            "fetching", "POST", "/v1/chat/completions", chat(image_part(lab.media() + "/slow.png"))
        ),
    ),
    (
        "media_fetch_failed",
        "the URL answered HTTP 404",
        lambda lab: lab.send(
            "fetching", "POST", "/v1/chat/completions", chat(image_part(lab.media() + "/gone.png"))
        ),
    ),
    (
        "media_fetch_failed",
        "the URL redirected more than 3 times",
        lambda lab: lab.send(
            "fetching", "POST", "/v1/chat/completions", chat(image_part(lab.media() + "/loop"))
        ),
    ),
    (
        "media_fetch_failed",
        "the URL returned 'text/html', not image",
        lambda lab: lab.send(
            "fetching", "POST", "/v1/chat/completions", chat(image_part(lab.media() + "/page.html"))
        ),
    ),
    (
        "media_fetch_failed",
        "the media is larger than the limit of 33554432 bytes",
        lambda lab: lab.send(
            "fetching", "POST", "/v1/chat/completions", chat(image_part(lab.media() + "/huge.png"))
        ),
    ),
    (
        "upstream_unavailable",
        "the upstream closed the connection mid-response",
        lambda lab: lab.last_stream_event("resetting", chat(stream=True)),
    ),
    (
        "not_found",
        "'/flush_cache' is not forwarded here (not in the policy's endpoints, or an engine's"
        " admin path)",
        lambda lab: lab.send("plain", "POST", "/flush_cache", {}),
    ),
    (
        "method_not_allowed",
        "/healthz answers GET, HEAD only",
        lambda lab: lab.send("plain", "POST", "/healthz", {}),
    ),
    (
        "method_not_allowed",
        "/v1/validate answers POST only",
        lambda lab: lab.send("plain", "GET", "/v1/validate"),
    ),
    (
        "media_id_not_allowed",
        "media ids and hashes are not passed on here (this gateway cannot rewrite them to ids"
        " bound to the caller and the bytes); send the media without them",
        lambda lab: lab.send(
            "refusing",
            "POST",
            "/v1/chat/completions",
            chat({**image_part(data_url(image_bytes())), "uuid": "photo-1"}),
        ),
    ),
    (
        "invalid_api_key",
        "the API key is not valid",
        lambda lab: lab.send(
            "locked", "POST", "/v1/chat/completions", chat(), authorization="Bearer wrong-key"
        ),
    ),
]

# Quoted messages no test here produces, and why.
UNPRODUCED = {
    # The write timeout is 60 s by default; the message is made by the same line as the
    # upstream_timeout example (modalgate.gateway.upstream.proxy._violation), and
    # test_proxy.py produces it with a 1 s write timeout and a 20 MB body.
    "the upstream did not take the request body within 60 s",
}

# ---------------------------------------------------------------- the examples


def _example_cases() -> list[Any]:
    cases = [
        pytest.param(code, index, example, id=f"{code}-{index}")
        for code, section in SECTIONS.items()
        for index, example in enumerate(json_examples(section))
    ]
    # The envelope section shows the first unsupported_modality example.
    cases.append(
        pytest.param("unsupported_modality", 0, json_examples(ENVELOPE_SECTION)[0], id="envelope")
    )
    return cases


@pytest.mark.parametrize(("code", "index", "documented"), _example_cases())
def test_each_example_is_what_the_code_produces(
    lab: Lab, code: str, index: int, documented: dict[str, Any]
) -> None:
    producers = EXAMPLES.get(code, [])
    assert index < len(producers), f"no request in EXAMPLES produces {code} example {index}"
    produced = producers[index](lab)
    assert produced.envelope == documented, (
        f"docs/errors.md {code} example {index} is stale; the code produces:\n"
        + json.dumps(produced.envelope, indent=2, ensure_ascii=False)
    )
    assert produced.status == STATUS[ErrorCode(code)]


def test_every_code_has_a_section_with_its_examples() -> None:
    assert list(SECTIONS) == [code.value for code in ErrorCode]  # all, in the catalogue's order
    for code, section in SECTIONS.items():
        count = len(json_examples(section))
        assert count >= 1, f"{code} has no example"
        assert count == len(EXAMPLES[code]), f"{code}: {count} examples, {len(EXAMPLES[code])}"


def test_each_section_states_its_status() -> None:
    for code, section in SECTIONS.items():
        stated = re.match(r"\s*\*\*(\d{3})", section)
        assert stated is not None, f"{code}'s section does not start with its status"
        assert int(stated.group(1)) == STATUS[ErrorCode(code)], code


def test_the_summary_table_is_the_catalogue() -> None:
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (\d{3}) \| (\w+) \|", DOC, re.M)
    assert [row[0] for row in rows] == [code.value for code in ErrorCode]
    for name, status, kind in rows:
        code = ErrorCode(name)
        assert (int(status), kind) == (STATUS[code], error_type(code)), name


def test_headers_the_page_names_are_sent(lab: Lab) -> None:
    """encoder_overloaded shows its response head; method_not_allowed names ``Allow``."""
    (head,) = fenced(SECTIONS["encoder_overloaded"], "http")
    status_line, *header_lines = head.strip().splitlines()
    produced = EXAMPLES["encoder_overloaded"][0](lab)
    assert int(status_line.split()[1]) == produced.status
    for line in header_lines:
        name, value = (part.strip() for part in line.split(":", 1))
        assert produced.headers[name] == value, name
    allow = re.search(r"with `Allow: ([A-Z, ]+)`", SECTIONS["method_not_allowed"])
    assert allow is not None
    assert EXAMPLES["method_not_allowed"][0](lab).headers["allow"] == allow.group(1)
    challenge = re.search(r"with `WWW-Authenticate: ([^`]+)`", SECTIONS["invalid_api_key"])
    assert challenge is not None
    produced = EXAMPLES["invalid_api_key"][0](lab)
    assert produced.headers["www-authenticate"] == challenge.group(1)


@pytest.mark.parametrize(
    ("code", "message", "producer"),
    MESSAGES,
    ids=[f"{code}-{i}" for i, (code, _, _) in enumerate(MESSAGES)],
)
def test_each_quoted_message_is_produced(
    lab: Lab, code: str, message: str, producer: Producer
) -> None:
    assert message in flat(SECTIONS[code]), f"{message!r} is not quoted in {code}'s section"
    error = producer(lab).envelope["error"]
    assert error["code"] == code
    assert error["message"] == message or error["message"].endswith(": " + message)


def test_the_unproduced_messages_are_still_quoted() -> None:
    """A stale entry in UNPRODUCED would hide nothing; keep the list honest."""
    for message in UNPRODUCED:
        assert any(message in flat(section) for section in SECTIONS.values()), message


def test_the_part_types_listed_are_the_validators() -> None:
    listed = re.search(
        r"the types servers know \((.*?)\)", flat(SECTIONS["unsupported_content_type"])
    )
    assert listed is not None
    names = set(re.findall(r"`([a-z0-9_]+)`", listed.group(1)))
    assert names | {"image_pil"} == set(PART_KINDS)


# ---------------------------------------------------------------- links


def _outside_fences(text: str) -> list[str]:
    """The lines of ``text`` with fenced blocks blanked: a ``#`` or a link there is code."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
            lines.append("")
        else:
            lines.append("" if in_fence else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped
    (backticks included), spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(document: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets GitHub's ``-1``, ``-2`` suffixes."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _outside_fences(document.read_text("utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            anchor = slug(heading.group(1))
            repeat = seen.get(anchor, 0)
            seen[anchor] = repeat + 1
            found.add(anchor if repeat == 0 else f"{anchor}-{repeat}")
    return found


LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(document: Path) -> list[str]:
    prose = "\n".join(_outside_fences(document.read_text("utf-8")))
    targets = LINK.findall(re.sub(r"`[^`\n]*`", "", prose))  # inline code is not a link
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("document", LINKED_DOCS, ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_a_heading(document: Path) -> None:
    dangling = []
    for target in relative_links(document):
        where, _, anchor = target.partition("#")
        resolved = (document.parent / where).resolve() if where else document
        missing_heading = resolved.suffix == ".md" and anchor != ""
        if not resolved.exists() or (missing_heading and anchor not in anchors(resolved)):
            dangling.append(target)
    assert dangling == [], f"{document.name}: dangling links {dangling}"
