"""The hostile corpus: every class of crash, stall and bypass the gate was broken by, kept fixed.

Each case goes through a real ``modalgate serve --upstream`` process to a recording
upstream, and asserts the status, the error code and param, and what the upstream
received: nothing for a refusal, the client's own bytes (or the normalised path)
for an acceptance.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from conftest import (
    MP4_BYTES,
    Recorder,
    b64,
    chat,
    data_url,
    image_bytes,
    image_part,
    send_body,
    serve,
    start_server,
)
from gateway_proc import GatewayProcess, raw_http
from media_stubs import jpeg_with
from toy_upstream import ToyUpstream

PNG = image_bytes("PNG", (40, 30))
URL = "messages.[0].content.[0].image_url.url"
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
PDF_PART = {"type": "input_file", "file_data": b64(b"%PDF-1.4 x"), "filename": "a.pdf"}
INLINE_VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
POLICY = {
    "extends": "builtin",
    "media_urls": {"schemes": ["data", "https", "http"], "allow_private": ["127.0.0.1/32"]},
    "models": [
        {"name": "stills", "accepts": ["image"]},
        {"name": "pictures", "accepts": ["image"], "fallback": {"video": "movies"}},
        {"name": "movies", "accepts": ["image", "video"]},
        {"name": "embedder", "accepts": ["image", "embeddings"]},
        {
            "name": "small-body",
            "accepts": ["image", "video"],
            "limits": {"max_body_bytes": 3_000_000, "max_fetched_bytes": 10_000_000},
        },
        {
            "name": "small-fetch",
            "accepts": ["image", "video"],
            "limits": {"max_fetched_bytes": len(PNG) * 3 // 2},
        },
    ],
}


@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[ToyUpstream, str]]:
    upstream = ToyUpstream()
    with serve(upstream.app()) as base:
        yield upstream, base


@pytest.fixture(scope="module")
def gateway(toy, tmp_path_factory) -> Iterator[GatewayProcess]:
    policy = tmp_path_factory.mktemp("policy") / "hostile.json"
    policy.write_bytes(orjson.dumps(POLICY))
    with GatewayProcess("--upstream", toy[1], "--policy", str(policy)) as process:
        yield process


@pytest.fixture
def upstream(toy) -> ToyUpstream:
    toy[0].received.clear()
    return toy[0]


def posted(upstream: ToyUpstream) -> list[Any]:
    """What reached the upstream from clients (the gateway reads /v1/models itself)."""
    return [r for r in upstream.received if r.method != "GET"]


@pytest.fixture(scope="module")
def media() -> Iterator[Recorder]:
    """Remote media on loopback: a 1.2 MB 'video' and a small PNG."""
    big_video = MP4_BYTES + b"\x00" * 1_200_000
    server = Recorder(
        ("127.0.0.1", 0),
        {
            "/v.mp4": lambda h: send_body(h, big_video, "video/mp4"),
            "/a.png": lambda h: send_body(h, PNG, "image/png"),
        },
    )
    start_server(server)
    yield server
    server.shutdown()


def post(gateway: GatewayProcess, where: str, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **headers}
    return httpx.post(gateway.url + where, content=content, headers=headers, timeout=30)


def refused(response: httpx.Response, status: int, code: str, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["violations"][0]["code"] == code
    return error


# ---------------------------------------------------------------- crashes


@pytest.mark.parametrize("url", ["https://xn--ls8h.la/a.png", "https://xn--/x.png"])
def test_hosts_idna_refuses_are_a_clean_refusal(gateway, upstream, url):
    response = post(gateway, "/v1/chat/completions", chat(image_part(url)))
    error = refused(response, 400, "url_not_allowed", "messages.[0].content.[0].image_url.url")
    assert error["message"].endswith("the URL cannot be parsed")
    assert upstream.received == []


@pytest.mark.parametrize("kind", [{"a": 1}, ["message"], 7])
def test_a_responses_item_type_that_is_not_a_string(gateway, upstream, kind):
    body = {"model": "kimi-k3", "input": [{"type": kind, "role": "user", "content": "hi"}]}
    refused(post(gateway, "/v1/responses", body), 400, "invalid_request", "input.[0].type")
    assert upstream.received == []


NUMBERS = (
    b'"seed":123456789012345678901234567890,"big":1e400,"tiny":-0.0,'
    b'"exact":0.1000000000000000055511151231257827,"neg":-18446744073709551617'
)


def test_a_rewritten_body_keeps_every_number_as_sent(gateway, upstream):
    # The fallback rewrites `model`; nothing else may change, numbers included.
    video = orjson.dumps(INLINE_VIDEO)
    raw = (
        b'{"model":"pictures",'
        + NUMBERS
        + b',"messages":[{"role":"user","content":['
        + video
        + b"]}]}"
    )
    response = post(gateway, "/v1/chat/completions", raw)
    assert response.status_code == 200, response.text
    assert response.headers["x-modalgate-routed-to"] == "movies"
    (received,) = upstream.received
    assert NUMBERS in received.body
    assert received.body.startswith(b'{"model":"movies",')


def test_inlined_media_keeps_every_number_as_sent(gateway, upstream, media):
    part = image_part(media.base + "/a.png")
    raw = b'{"model":"movies",' + NUMBERS + b',"messages":[{"role":"user","content":['
    raw += orjson.dumps(part) + b"]}]}"
    assert post(gateway, "/v1/chat/completions", raw).status_code == 200
    (received,) = upstream.received
    assert NUMBERS in received.body
    sent = received.json()["messages"][0]["content"][0]["image_url"]["url"]
    assert sent == data_url(PNG)


# ---------------------------------------------------------------- resource use


def test_inlined_media_obeys_the_body_cap(gateway, upstream, media):
    # An 800-byte request with video links must not become a multi-megabyte forward.
    parts = [{"type": "video_url", "video_url": {"url": media.base + "/v.mp4"}}] * 3
    response = post(gateway, "/v1/chat/completions", chat(*parts, model="small-body"))
    error = refused(response, 413, "payload_too_large", None)
    assert "inlined" in error["message"]
    assert upstream.received == []


def test_fetched_bytes_per_request_are_capped(gateway, upstream, media):
    # Each image is under the cap; the two together are not.
    image = image_part(media.base + "/a.png")
    response = post(gateway, "/v1/chat/completions", chat(image, image, model="small-fetch"))
    error = refused(response, 400, "media_fetch_failed", None)
    assert "add up to" in error["message"]
    assert upstream.received == []


def test_video_counts_have_a_finite_default(gateway, upstream):
    response = post(gateway, "/v1/chat/completions", chat(*[VIDEO] * 5, model="movies"))
    refused(response, 400, "too_many_media", "messages.[0].content.[4]")
    assert upstream.received == []


def test_an_image_of_empty_segments_is_refused_before_it_is_read(gateway, upstream):
    """4 MB of 4-byte JPEG comment segments: each cost a Python step of the walk and of
    Pillow's header reader (0.7 s of a validation thread per MB), now counted against a
    budget."""
    hostile = jpeg_with(b"\xff\xfe\x00\x02" * 1_000_000)
    body = chat(image_part(data_url(hostile, "image/jpeg")), model="stills")
    error = refused(post(gateway, "/v1/chat/completions", body), 400, "invalid_image", URL)
    assert error["message"].endswith(
        f"the JPEG data is corrupt (more segments than any encoder writes in {len(hostile)} bytes)"
    )
    assert upstream.received == []


# ---------------------------------------------------------------- bypasses: the model


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [VIDEO]}]},
        {"model": None, "messages": [{"role": "user", "content": [VIDEO]}]},
        {"model": "", "messages": [{"role": "user", "content": [VIDEO]}]},
    ],
    ids=["missing", "null", "empty"],
)
def test_a_request_without_a_model_is_refused(gateway, upstream, body):
    error = refused(post(gateway, "/v1/chat/completions", body), 400, "invalid_request", "model")
    assert error["message"] == "model: 'model' is required"
    assert upstream.received == []


def test_requests_are_judged_as_the_model_the_upstream_serves(tmp_path):
    # The upstream lists one model the policy knows (kimi-k3: images only); a request
    # naming an omni model is judged as kimi-k3, since that is what will answer it.
    served = ToyUpstream(name="kimi-k3")
    with serve(served.app()) as base, GatewayProcess("--upstream", base) as gateway:
        response = post(gateway, "/v1/chat/completions", chat(VIDEO, model="qwen2.5-omni"))
        error = refused(response, 400, "unsupported_modality", "messages.[0].content.[0].type")
        assert "Kimi-K3" in error["message"]
        image = post(gateway, "/v1/chat/completions", chat(image_part(data_url(PNG)), model="x"))
        assert image.status_code == 200
    assert [r.json()["model"] for r in posted(served)] == ["x"]  # forwarded as sent


def test_a_configured_served_model_wins(toy):
    upstream, base = toy
    upstream.received.clear()
    with GatewayProcess("--upstream", base, "--served-model", "kimi-k3") as gateway:
        response = post(gateway, "/v1/chat/completions", chat(VIDEO, model="qwen3-omni"))
        refused(response, 400, "unsupported_modality", "messages.[0].content.[0].type")
    assert posted(upstream) == []


# ---------------------------------------------------------------- bypasses: parts


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "text", "text": "x", "uuid": "u", "video_embeds": "AAAA"}, "type"),
        ({"type": "text", "text": "x", "uuid": "u", "video_url": {"url": "https://e/v"}}, "type"),
        # no type: an OpenAI-compatible upstream (this toy) needs one; vLLM reads the key
        ({"uuid": "u", "video_url": {"url": "https://e/v.mp4"}}, "type"),
        ({"type": "video_embeds", "video_embeds": "AAAA"}, "type"),
    ],
    ids=["text-uuid-video-embeds", "text-uuid-video-url", "typeless-uuid", "typed-video-embeds"],
)
def test_parts_are_judged_as_the_engine_reads_them(gateway, upstream, part, param):
    response = post(gateway, "/v1/chat/completions", chat(part, model="stills"))
    code = "invalid_request" if part.get("type") in ("text", None) else "unsupported_modality"
    refused(response, 400, code, f"messages.[0].content.[0].{param}")
    assert upstream.received == []


def test_audio_in_video_is_audio(gateway, upstream):
    body = chat(VIDEO, model="movies", mm_processor_kwargs={"use_audio_in_video": True})
    response = post(gateway, "/v1/chat/completions", body)
    refused(response, 400, "unsupported_modality", "mm_processor_kwargs.use_audio_in_video")
    body = chat(VIDEO, model="movies", use_audio_in_video=True)  # SGLang's spelling
    refused(
        post(gateway, "/v1/chat/completions", body),
        400,
        "unsupported_modality",
        "use_audio_in_video",
    )
    assert upstream.received == []


def test_embeddings_in_assistant_reasoning(gateway, upstream):
    body = {
        "model": "stills",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "ok",
                "reasoning_content": [{"type": "prompt_embeds", "data": "AAAA"}],
            },
        ],
    }
    response = post(gateway, "/v1/chat/completions", body)
    refused(response, 400, "unsupported_modality", "messages.[1].reasoning_content.[0].type")
    assert upstream.received == []


# ---------------------------------------------------------------- bypasses: Responses items


@pytest.mark.parametrize(
    ("item", "code", "param"),
    [
        (
            {"type": "item_reference", "id": "r", "role": "user", "content": [VIDEO]},
            "unsupported_modality",
            "input.[0].content.[0].type",
        ),
        (
            {"type": "item_reference", "role": "user", "content": [PDF_PART]},
            "unsupported_modality",
            "input.[0].content.[0].type",
        ),
        (
            {
                "type": "computer_call_output",
                "call_id": "c",
                "output": {
                    "type": "computer_screenshot",
                    "image_url": "http://169.254.169.254/latest/meta-data",
                },
            },
            "url_not_allowed",
            "input.[0].output.image_url",
        ),
        (
            {"type": "hologram_call", "content": [{"type": "input_text", "text": "x"}]},
            "invalid_request",
            "input.[0].type",
        ),
        (INLINE_VIDEO, "unsupported_modality", "input.[0].type"),
        (
            {"type": "audio_url", "uuid": "item-1", "audio_url": None},
            "unsupported_modality",
            "input.[0].audio_url",
        ),
    ],
    ids=[
        "item-reference-video",
        "item-reference-file",
        "screenshot-ssrf",
        "unknown-with-content",
        "part-as-item",
        "cached-part-as-item",
    ],
)
def test_every_responses_item_with_content_is_walked(gateway, upstream, item, code, param):
    body = {"model": "stills", "input": [item]}
    refused(post(gateway, "/v1/responses", body), 400, code, param)
    assert upstream.received == []


# ---------------------------------------------------------------- bypasses: paths and doors


@pytest.mark.parametrize(
    "raw_path",
    [
        b"/v1/./chat/completions",
        b"//v1/chat/completions",
        b"/v1/x/../chat/completions",
        b"/v1/chat%2Fcompletions",
        b"/v1//chat%2fcompletions",
    ],
)
def test_path_spellings_are_gated_and_forwarded_normalised(gateway, upstream, raw_path):
    refusal = raw_post(gateway, raw_path, orjson.dumps(chat(VIDEO, model="stills")))
    assert refusal.startswith(b"HTTP/1.1 400 ")
    assert b'"code":"unsupported_modality"' in refusal
    assert upstream.received == []
    accepted = raw_post(gateway, raw_path, orjson.dumps(chat(model="stills")))
    assert accepted.startswith(b"HTTP/1.1 200 ")
    (received,) = upstream.received
    assert received.raw_path == b"/v1/chat/completions"


def raw_post(gateway: GatewayProcess, raw_path: bytes, body: bytes) -> bytes:
    return raw_http(
        gateway,
        b"POST " + raw_path + b" HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body,
    )


@pytest.mark.parametrize("method", ["PUT", "PATCH", "GET", "DELETE"])
def test_other_methods_with_a_body_on_a_gated_path(gateway, upstream, method):
    body = orjson.dumps(chat(VIDEO, model="stills"))
    response = httpx.request(method, gateway.url + "/v1/chat/completions", content=body, timeout=10)
    refused(response, 405, "method_not_allowed", None)
    assert response.headers["allow"] == "POST"
    assert upstream.received == []


VIDEO_CHAT = chat(VIDEO, model="stills")
CONTENT_TYPE = "messages.[0].content.[0].type"


def generate(**media: Any) -> dict[str, Any]:
    return {"model": "stills", "text": "x", **media}


@pytest.mark.parametrize(
    ("where", "body", "code", "param"),
    [
        ("/tokenize", VIDEO_CHAT, "unsupported_modality", CONTENT_TYPE),
        ("/v1/embeddings", VIDEO_CHAT, "unsupported_modality", CONTENT_TYPE),
        (
            "/v1/completions",
            {"model": "stills", "prompt": "x", "prompt_embeds": "AAAA"},
            "unsupported_modality",
            "prompt_embeds",
        ),
        (
            "/generate",
            generate(video_data=["https://e/v.mp4"]),
            "unsupported_modality",
            "video_data.[0]",
        ),
        ("/generate", generate(image_data="/etc/passwd"), "invalid_base64", "image_data"),
        (
            "/tokenize",
            {"model": "stills", "input": [{"role": "user", "content": [VIDEO]}]},
            "invalid_request",
            "input.[0]",
        ),
        (
            "/generate",
            generate(image_data=[{"format": "processor_output"}]),
            "invalid_request",
            "image_data.[0]",
        ),
    ],
    ids=[
        "tokenize",
        "embeddings",
        "completions-embeds",
        "generate-video",
        "generate-file-path",
        "tokenize-message-as-input",
        "generate-object",
    ],
)
def test_the_engines_other_doors_are_gated(gateway, upstream, where, body, code, param):
    refused(post(gateway, where, body), 400, code, param)
    assert upstream.received == []


def test_clean_requests_through_other_doors_reach_the_upstream(gateway, upstream):
    image = b64(PNG)
    for where, body in [
        ("/tokenize", chat(image_part(data_url(PNG)), model="stills")),
        ("/v1/completions", {"model": "stills", "prompt": "x"}),
        ("/generate", {"model": "stills", "text": "x", "image_data": [image]}),
    ]:
        assert post(gateway, where, body).status_code == 200
    assert [r.path for r in upstream.received] == ["/tokenize", "/v1/completions", "/generate"]


def test_admin_paths_are_not_forwarded(gateway, upstream):
    refused(post(gateway, "/flush_cache", {}), 404, "not_found", None)
    assert upstream.received == []


DUPLICATE_TYPE = (
    b'{"model":"movies","messages":[{"role":"user","content":[{"type":"image_url",'
    b'"type":"video_url","video_url":{"url":"https://e/v.mp4"}}]}]}'
)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'{"model":"pictures","model":"movies","messages":[]}', "model"),
        (DUPLICATE_TYPE, "type"),
    ],
    ids=["top-level", "nested"],
)
def test_duplicate_keys_are_refused(gateway, upstream, raw, key):
    error = refused(post(gateway, "/v1/chat/completions", raw), 400, "invalid_json", None)
    assert f"repeats the key '{key}'" in error["message"]
    assert upstream.received == []


# ---------------------------------------------------------------- false rejects


def image_with(detail: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": detail}}


def responses(*items: Any) -> dict[str, Any]:
    return {"model": "stills", "input": list(items)}


INPUT_IMAGE = {"type": "input_image", "image_url": data_url(PNG), "detail": "original"}


@pytest.mark.parametrize(
    ("where", "body"),
    [
        ("/v1/chat/completions", chat(image_with("original"), model="stills")),
        # SGLang's "default" is taken where the upstream is SGLang (its dialect):
        # tests/conformance/test_engine_dialects_served.py
        ("/v1/chat/completions", chat(image_with("low"), model="stills")),
        (
            "/v1/chat/completions",
            chat({"type": "video_embeds", "video_embeds": "AAAA"}, model="embedder"),
        ),
        ("/v1/responses", responses({"role": "user", "content": [INPUT_IMAGE]})),
        (
            "/v1/responses",
            responses({"type": "function_call_output", "call_id": "c", "output": [INPUT_IMAGE]}),
        ),
    ],
    ids=[
        "detail-original",
        "detail-low",
        "video-embeds",
        "responses-original",
        "tool-output-image",
    ],
)
def test_what_the_engines_accept_is_accepted(gateway, upstream, where, body):
    raw = orjson.dumps(body)
    response = post(gateway, where, raw)
    assert response.status_code == 200, response.text
    (received,) = upstream.received
    assert received.body == raw


def test_a_cached_reference_goes_on_as_its_callers_fill_did(gateway, upstream):
    """vLLM's reference by id alone is accepted where the caller filled the id here, and
    goes on with the id the fill got (docs/security.md#media-ids), never the client's."""
    fill = {"type": "image_url", "image_url": {"url": data_url(PNG)}, "uuid": "cached-1"}
    assert (
        post(gateway, "/v1/chat/completions", orjson.dumps(chat(fill, model="stills"))).status_code
        == 200
    )
    (filled,) = upstream.received
    upstream.received.clear()
    reference = {"type": "image_url", "image_url": None, "uuid": "cached-1"}
    raw = orjson.dumps(chat(reference, model="stills"))
    assert post(gateway, "/v1/chat/completions", raw).status_code == 200
    (received,) = upstream.received
    bound = orjson.loads(filled.body)["messages"][0]["content"][0]["uuid"]
    assert bound != "cached-1"
    assert orjson.loads(received.body)["messages"][0]["content"][0]["uuid"] == bound


def test_a_body_with_a_byte_order_mark_is_accepted_and_forwarded_as_sent(gateway, upstream):
    raw = b"\xef\xbb\xbf" + orjson.dumps(chat(image_part(data_url(PNG)), model="stills"))
    assert post(gateway, "/v1/chat/completions", raw).status_code == 200
    (received,) = upstream.received
    assert received.body == raw


def test_the_gateways_own_paths_answer_a_wrong_method_with_the_envelope(gateway, upstream):
    response = post(gateway, "/v1/models/kimi-k3", chat(model="stills"))
    error = refused(response, 405, "method_not_allowed", None)
    assert error["message"] == "/v1/models/kimi-k3 answers GET, HEAD only"
    assert response.headers["allow"] == "GET, HEAD"
    assert posted(upstream) == []
