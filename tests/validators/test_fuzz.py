"""Property tests: whatever arrives, validation answers with a Verdict and never raises.

``MODALGATE_FUZZ_SCALE`` multiplies every example count (default 1: the whole
file runs in well under a minute on two cores).
"""

from __future__ import annotations

import os
import re
from typing import Any

import orjson
import pybase64
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import (
    MP4_BYTES,
    PDF_BYTES,
    WAV_BYTES,
    animated_gif,
    image_bytes,
    png_bomb,
)
from modalgate.errors import STATUS, ErrorCode, Violation, error_json
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.validators import Verdict, validate_body, validate_request
from modalgate.validators.json_body import rewrite_json_body

SCALE = max(1, int(os.environ.get("MODALGATE_FUZZ_SCALE", "1")))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


BUILTIN = load_policy()
# Everything opened up, so hostile bytes reach every Pillow plugin and every URL branch.
PERMISSIVE = parse_policy(
    """
unknown_models: reject
limits:
  image_formats: [jpeg, png, webp, gif, bmp, tiff, avif, ico]
  allow_animated: true
  min_image_side: 1
  max_images: 4
media_roles: [user, system, assistant, tool]
media_urls:
  schemes: [data, https, http, file]
  allow_private: ["127.0.0.0/8", "::1/128"]
models:
  - name: everything
    match: ["any-*"]
    accepts: [image, video, audio, file, embeddings]
  - name: pictures
    accepts: [image]
    message: "pictures only"
""",
    fmt="yaml",
)
MATCHERS = [
    RuleMatcher(BUILTIN, "encoder"),
    RuleMatcher(BUILTIN, None),
    RuleMatcher(PERMISSIVE, None),
]
KNOWN_CODES = set(ErrorCode)
# A message about hostile bytes must not carry what Pillow or Python said about them.
_INTERNALS = re.compile(r"Traceback|\b0x[0-9a-fA-F]+|object at|Error\(|File \"|\.py\b")


def check_verdict(verdict: Any) -> Verdict:
    """The invariants of every answer, accepted or not."""
    assert isinstance(verdict, Verdict)
    for violation in verdict.violations:
        assert isinstance(violation, Violation)
        assert violation.code in KNOWN_CODES
        assert violation.status == STATUS[violation.code]
        assert isinstance(violation.message, str) and violation.message
        assert violation.param is None or isinstance(violation.param, str)
    if verdict.accepted:
        assert verdict.status == 200
    else:
        assert verdict.status == verdict.violations[0].status
        orjson.loads(error_json(verdict.violations))
    orjson.dumps(verdict.to_dict())
    return verdict


def check_accepted_parts(verdict: Verdict) -> None:
    """What an accepted verdict promises the next stage."""
    if not verdict.accepted:
        return
    rule = verdict.rule
    assert rule is not None
    for part in verdict.parts:
        assert part.modality in rule.accepts, (part.modality, rule.accepts)
        assert part.role in rule.media_roles
        assert part.part_type != "image_pil"  # never valid over HTTP, typed or inferred
        if part.modality in ("image", "video", "audio", "file"):
            assert part.source in ("data", "url", "base64", "file_id"), part.facts()
        if part.modality == "image" and part.data is not None:
            assert part.format in rule.limits.image_formats
            assert part.width is not None and part.height is not None
            assert part.width * part.height <= rule.limits.max_image_pixels
            assert min(part.width, part.height) >= rule.limits.min_image_side
            assert len(part.data) <= rule.limits.max_image_bytes
    images = sum(1 for p in verdict.parts if p.modality == "image")
    if rule.limits.max_images is not None:
        assert images <= rule.limits.max_images


# ---------------------------------------------------------------- (a) any JSON value

json_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=20)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(json_text, children, max_size=5)
    ),
    max_leaves=30,
)
# Objects that look a little like requests, so the walk goes deeper than the first check.
near_requests = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["kimi-k3", "gpt-4o", "pictures", "any-x"]) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_values,
                    "content": json_values
                    | st.lists(
                        st.dictionaries(
                            st.sampled_from(
                                [
                                    "type",
                                    "text",
                                    "image_url",
                                    "video_url",
                                    "input_audio",
                                    "uuid",
                                    "file",
                                    "file_data",
                                    "file_id",
                                    "url",
                                    "detail",
                                    "image_pil",
                                ]
                            ),
                            json_values,
                            max_size=4,
                        ),
                        max_size=4,
                    ),
                },
            )
            | json_values,
            max_size=3,
        )
        | json_values,
    },
)


@fuzz(800)
@given(value=json_values | near_requests, which=st.sampled_from(range(len(MATCHERS))))
def test_any_json_value_gets_a_verdict(value, which):
    raw = orjson.dumps(value)
    verdict = check_verdict(validate_body(raw, MATCHERS[which]))
    if not isinstance(value, dict):
        assert verdict.violations[0].code is ErrorCode.INVALID_JSON
    check_accepted_parts(verdict)


# ---------------------------------------------------------------- (b) any bytes

byte_bodies = (
    st.binary(max_size=512)
    | st.builds(
        lambda head, tail: head + tail,
        st.sampled_from([b"{", b'{"model":', b"[", b'{"messages":[{"role":"user","content":[']),
        st.binary(max_size=64),
    )
    | st.builds(lambda text: text.encode("utf-8", "surrogatepass"), st.text(max_size=200))
)


@fuzz(1000)
@given(raw=byte_bodies, which=st.sampled_from(range(len(MATCHERS))))
def test_any_bytes_get_a_verdict(raw, which):
    verdict = check_verdict(validate_body(raw, MATCHERS[which]))
    check_accepted_parts(verdict)


# ---------------------------------------------------------------- (c) request-shaped


REAL_MEDIA = {
    "png": image_bytes("PNG"),
    "jpeg": image_bytes("JPEG"),
    "webp": image_bytes("WEBP"),
    "gif": image_bytes("GIF"),
    "animated": animated_gif(3),
    "bmp": image_bytes("BMP", size=(8, 8)),
    "tiff": image_bytes("TIFF", size=(8, 8)),
    "ico": image_bytes("ICO", size=(16, 16)),
    "tiny": image_bytes("PNG", size=(1, 1)),
    "bomb": png_bomb(100_000, 100_000),
    "mp4": MP4_BYTES,
    "wav": WAV_BYTES,
    "pdf": PDF_BYTES,
}
MIMES = [
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
    "video/mp4",
    "audio/wav",
    "application/pdf",
    "application/octet-stream",
    "text/plain",
    "",
]


def b64(data: bytes) -> str:
    return pybase64.b64encode(data).decode()


real_bytes = st.sampled_from(sorted(REAL_MEDIA)).map(REAL_MEDIA.__getitem__)
truncated_bytes = st.builds(
    lambda data, cut: data[: max(0, len(data) - cut)], real_bytes, st.integers(1, 200)
)
media_payloads = st.one_of(real_bytes, truncated_bytes, st.binary(max_size=256))
mimes = st.sampled_from(MIMES) | st.text(max_size=30).filter(lambda s: "," not in s)


@st.composite
def payload_urls(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["data", "data", "data", "bare", "remote", "junk"]))
    if kind == "data":
        encoded = b64(draw(media_payloads))
        if draw(st.booleans()):
            encoded = draw(st.sampled_from(["", "!", "=", "\n", "A"])) + encoded
        if draw(st.booleans()):
            encoded = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
        marker = draw(st.sampled_from([";base64", ";BASE64", "", ";charset=utf-8;base64"]))
        return f"data:{draw(mimes)}{marker},{encoded}"
    if kind == "bare":
        return b64(draw(media_payloads))
    if kind == "remote":
        scheme = draw(st.sampled_from(["https", "http", "ftp", "file", "HTTPS", ""]))
        host = draw(
            st.sampled_from(
                [
                    "example.com",
                    "127.0.0.1",
                    "[::1]",
                    "2130706433",
                    "localhost",
                    "10.0.0.1",
                    "169.254.169.254",
                    "u:p@example.com",
                    "[::ffff:127.0.0.1]",
                    "0x7f.1",
                    "",
                ]
            )
            | st.text(max_size=20)
        )
        return f"{scheme}://{host}/{draw(st.text(max_size=10))}"
    return draw(st.text(max_size=40))


def url_holder(url: str, as_object: bool, detail: Any) -> Any:
    if not as_object:
        return url
    holder: dict[str, Any] = {"url": url}
    if detail is not None:
        holder["detail"] = detail
    return holder


details = st.none() | st.sampled_from(["auto", "low", "high", "ultra"]) | json_scalars


@st.composite
def content_parts(draw: st.DrawFn) -> Any:
    shape = draw(
        st.sampled_from(
            [
                "text",
                "text",
                "image_url",
                "image_url",
                "image_url",
                "video_url",
                "audio_url",
                "input_audio",
                "file",
                "input_image",
                "input_file",
                "embeds",
                "typeless",
                "typeless",
                "typeless",
                "smuggled",
                "unknown",
                "random",
                "bare_string",
            ]
        )
    )
    url = draw(payload_urls())
    if shape == "text":
        return {"type": draw(st.sampled_from(["text", "input_text", "refusal"])), "text": "x"} | (
            {"refusal": "no"} if draw(st.booleans()) else {}
        )
    if shape in ("image_url", "video_url", "audio_url"):
        return {"type": shape, shape: url_holder(url, draw(st.booleans()), draw(details))}
    if shape == "input_audio":
        data = b64(draw(media_payloads)) if draw(st.booleans()) else url
        return {
            "type": "input_audio",
            "input_audio": {"data": data, "format": draw(st.sampled_from(["wav", "mp3", 7]))},
        }
    if shape == "file":
        inner = draw(
            st.sampled_from([{"file_data": url}, {"file_id": "file-1"}, {"filename": "a.pdf"}, {}])
        )
        return {"type": "file", "file": inner}
    if shape == "input_image":
        return {"type": "input_image", "image_url": url, "detail": draw(details)}
    if shape == "input_file":
        key = draw(st.sampled_from(["file_data", "file_url", "file_id"]))
        return {"type": "input_file", key: url}
    if shape == "embeds":
        key = draw(st.sampled_from(["image_embeds", "audio_embeds"]))
        return {"type": key, key: draw(st.sampled_from(["AAAA", {"a": "AAAA"}, 5, None]))}
    if shape == "typeless":
        key = draw(st.sampled_from(["image_url", "video_url", "audio_url", "image_pil"]))
        return {key: {"url": url}}
    if shape == "smuggled":
        key = draw(st.sampled_from(["video_url", "audio_url", "input_audio", "image_url"]))
        return {"type": "text", "text": "x", "uuid": "1", key: {"url": url}}
    if shape == "unknown":
        return {"type": draw(st.text(max_size=12)), "image_url": {"url": url}}
    if shape == "bare_string":
        return draw(st.text(max_size=10))
    return draw(json_values)


roles = st.sampled_from(["user", "user", "user", "system", "assistant", "tool", "developer"])
models = st.sampled_from(
    [
        "kimi-k3",
        "gpt-4o",
        "qwen2.5-vl",
        "qwen2-audio",
        "kimi-k2.5",
        "gemma-3-1b",
        "pictures",
        "any-model",
        "unknown/model",
    ]
) | st.text(max_size=12)
messages = st.fixed_dictionaries(
    {
        "role": roles,
        "content": st.lists(content_parts(), min_size=0, max_size=5) | st.text(max_size=10),
    }
)
requests = st.fixed_dictionaries(
    {"model": models, "messages": st.lists(messages, min_size=1, max_size=3)},
    optional={"stream": st.booleans()},
)


@fuzz(1200)
@given(request=requests, which=st.sampled_from(range(len(MATCHERS))))
def test_request_shaped_input_gets_a_verdict(request, which):
    matcher = MATCHERS[which]
    verdict = check_verdict(validate_body(orjson.dumps(request), matcher))
    check_accepted_parts(verdict)
    event(verdict.violations[0].code.value if verdict.violations else "accepted")
    # The parsed-request entry point agrees with the bytes entry point.
    again = check_verdict(validate_request(orjson.loads(orjson.dumps(request)), matcher))
    assert [v.as_dict() for v in again.violations] == [v.as_dict() for v in verdict.violations]


@fuzz(800)
@given(
    part=content_parts(),
    model=st.sampled_from(["kimi-k3", "gpt-4o", "kimi-k2.5", "qwen2-audio", "any-model"]),
    which=st.sampled_from(range(len(MATCHERS))),
)
def test_one_part_gets_a_verdict(part, model, which):
    # One part in a user message: most requests get past the shape checks, so the
    # promises of an accepted verdict are tested against every part shape.
    request = {"model": model, "messages": [{"role": "user", "content": [part]}]}
    verdict = check_verdict(validate_body(orjson.dumps(request), MATCHERS[which]))
    check_accepted_parts(verdict)
    event(verdict.violations[0].code.value if verdict.violations else "accepted")


# ---------------------------------------------------------------- (d) hostile image bytes

# Magic numbers, so random bytes get past sniffing into the header parsers; trailers, so
# they get past the end-of-file checks too.
MAGIC = [
    b"\x89PNG\r\n\x1a\n",
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
    b"\xff\xd8\xff",
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00",
    b"GIF87a",
    b"GIF89a",
    b"RIFF\x00\x00\x00\x00WEBPVP8 ",
    b"RIFF\xff\xff\xff\x00WEBPVP8L",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
    b"\x00\x00\x01\x00",
    b"\x00\x00\x00\x18ftypavif",
]
TRAILERS = [b"", b"IEND\xaeB`\x82", b"\xff\xd9", b";"]


def mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    buffer = bytearray(data)
    for position, value in edits:
        if buffer:
            buffer[position % len(buffer)] = value
    return bytes(buffer)


image_payloads = st.one_of(
    st.binary(max_size=512),
    st.builds(
        lambda magic, body, trailer: magic + body + trailer,
        st.sampled_from(MAGIC),
        st.binary(max_size=256),
        st.sampled_from(TRAILERS),
    ),
    st.builds(
        mutate,
        real_bytes,
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    ),
    truncated_bytes,
)


@fuzz(1200)
@given(
    data=image_payloads,
    mime=st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp", ""]),
    which=st.sampled_from(range(len(MATCHERS))),
)
def test_any_bytes_as_an_image_get_a_verdict(data, mime, which):
    request = {
        "model": "pictures" if which == 2 else "kimi-k3",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(data)}"}}
                ],
            }
        ],
    }
    verdict = check_verdict(validate_body(orjson.dumps(request), MATCHERS[which]))
    check_accepted_parts(verdict)
    event(verdict.violations[0].code.value if verdict.violations else "accepted")
    for violation in verdict.violations:
        assert violation.param == "messages.[0].content.[0].image_url.url"
        assert not _INTERNALS.search(violation.message), violation.message
    if verdict.accepted:
        (part,) = verdict.parts
        assert part.data == data


# ---------------------------------------------------------------- (e) every body kind, rewrites

API_KINDS = ["chat", "responses", "completions", "messages", "generate"]


@fuzz(600)
@given(
    value=json_values | near_requests,
    api=st.sampled_from(API_KINDS),
    which=st.sampled_from(range(len(MATCHERS))),
)
def test_every_body_kind_gets_a_verdict(value, api, which):
    verdict = check_verdict(validate_body(orjson.dumps(value), MATCHERS[which], api))
    check_accepted_parts(verdict)


# Numbers a plain re-serialisation cannot reproduce, written as raw JSON text.
raw_numbers = st.sampled_from(
    [b"1e400", b"-1e400", b"123456789012345678901234567890", b"-0.0", b"1.10", b"1E-400",
     b"0.1000000000000000055511151231257827", b"18446744073709551616", b"-9223372036854775809"]
)  # fmt: skip


@fuzz(300)
@given(numbers=st.lists(raw_numbers, min_size=1, max_size=6), model=st.text(max_size=20))
def test_a_rewrite_changes_only_what_it_replaces(numbers, model):
    fields = b",".join(b'"n%d":%s' % (i, n) for i, n in enumerate(numbers))
    body = b'{"model":"x",' + fields + b',"nested":{"list":[' + b",".join(numbers) + b"]}}"
    rewritten = rewrite_json_body(body, [(("model",), model)])
    assert rewritten == b'{"model":' + orjson.dumps(model) + body[len(b'{"model":"x"') :]


@fuzz(300)
@given(key=st.text(min_size=1, max_size=12), depth=st.integers(0, 4))
def test_a_duplicate_key_at_any_depth_is_refused(key, depth):
    inner = b"{" + orjson.dumps(key) + b":1," + orjson.dumps(key) + b":2}"
    for _ in range(depth):
        inner = b'{"a":[' + inner + b"]}"
    body = b'{"model":"kimi-k3","messages":[],"x":' + inner + b"}"
    verdict = check_verdict(validate_body(body, MATCHERS[0]))
    assert verdict.violations[0].code is ErrorCode.INVALID_JSON
    assert "repeats the key" in verdict.violations[0].message
