"""Bodies shaped to cost the gate more than their size: held to bounded work and memory.

A body of millions of tiny values (``{}``) would parse to a tree many times its size:
it is refused before parsing (``tree_problem``), while a body as big made of long
strings or base64 is taken. A bad body's UTF-8 is checked a MiB at a time
(``_is_utf8``). A vLLM-dialect part is tried only against the union members its
``type`` can match, not against all 17 (``vllm_union._taken``).
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest

from conftest import body, chat, data_url, image_part, noise_png
from modalgate.errors import ErrorCode
from modalgate.policy import RuleMatcher, load_policy
from modalgate.settings import EngineSpec
from modalgate.validators import validate_body, vllm_union
from modalgate.validators.dialects import dialect_for
from modalgate.validators.json_body import (
    TREE_ALLOWANCE_BYTES,
    TREE_BYTES_PER_BODY_BYTE,
    _is_utf8,
)

MIB = 1 << 20
VLLM = dialect_for(EngineSpec(name="vllm"))


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(load_policy(), None)


def empty_objects(count: int) -> bytes:
    """A valid chat body whose metadata holds ``count`` empty objects."""
    head = b'{"model":"kimi-k3","messages":[{"role":"user","content":"hi"}],"metadata":{"a":['
    return head + b",".join([b"{}"] * count) + b"]}}"


# ---------------------------------------------------------------- the parsed tree's size


def test_a_body_of_millions_of_empty_objects_is_refused_before_parsing(matcher):
    raw = empty_objects(10_000_000)
    assert len(raw) > 30_000_000
    allowed = TREE_BYTES_PER_BODY_BYTE * len(raw) + TREE_ALLOWANCE_BYTES
    verdict = validate_body(raw, matcher)
    assert not verdict.accepted and verdict.status == 413
    [violation] = verdict.violations
    assert violation.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert violation.param is None
    assert violation.message == (
        "the request body holds too many JSON values for its size: parsed, they could take"
        f" more than {allowed} bytes of memory; send fewer, larger values (long strings"
        " and base64 cost little)"
    )


def test_empty_objects_inside_strings_are_not_counted(matcher):
    """The same 30 MB of ``{},`` as text in a string: a string, parsed, costs its size."""
    filler = ",".join(["{}"] * 10_000_000)
    raw = body(chat({"type": "text", "text": filler}))
    assert len(raw) > 30_000_000
    verdict = validate_body(raw, matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]


def test_a_30_mb_prose_body_with_commas_is_taken(matcher):
    raw = body(chat({"type": "text", "text": "lorem ipsum, dolor: sit [amet] " * 1_000_000}))
    assert len(raw) > 30_000_000
    verdict = validate_body(raw, matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]


def test_a_30_mb_plain_text_body_is_taken(matcher):
    raw = body(chat({"type": "text", "text": "lorem ipsum dolor sit amet " * 1_200_000}))
    assert len(raw) > 30_000_000
    verdict = validate_body(raw, matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]


def test_a_big_image_body_is_taken(matcher):
    png = noise_png(1536, 1536, seed=11)  # photo-like: ~7 MB of PNG, ~9.5 MB of base64
    raw = body(chat({"type": "text", "text": "what is this?"}, image_part(data_url(png))))
    assert len(raw) > 9_000_000
    verdict = validate_body(raw, matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    assert [p.modality for p in verdict.parts] == ["image"]


# ---------------------------------------------------------------- UTF-8 a MiB at a time


def test_utf8_straddling_the_mib_boundary_is_valid():
    euro = "\u20ac".encode()  # 3 bytes
    for offset in (1, 2):  # the boundary after its first, then its second byte
        raw = b"a" * (MIB - offset) + euro + "\u00e9\U0001f600".encode() * MIB
        assert raw[MIB - offset : MIB - offset + 3] == euro
        assert _is_utf8(raw)


def test_an_invalid_byte_after_the_first_mib_is_found():
    assert not _is_utf8(b"a" * (3 * MIB) + b"\xff" + b"a" * 10)
    assert not _is_utf8(b"a" * (MIB + 5) + b"\xc3")  # cut short at the end
    assert not _is_utf8(b"a" * (MIB - 1) + b"\xe2\x82" + b"a")  # broken across the boundary
    assert _is_utf8(b"") and _is_utf8(b"a" * (MIB + 1))


def test_the_utf8_check_holds_a_mib_at_a_time_not_the_whole_string():
    raw = "\u00e9".encode() * (8 * MIB)  # 16 MiB: as one str, 16 MiB more (its 2 B chars)
    tracemalloc.start()
    try:
        assert _is_utf8(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB, peak


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"kimi-k3","messages":[{"role":"user","content":"'
        + b"a" * (3 * MIB)
        + b'\xff"}]}',
        b'{"model":"kimi-k3","x":"' + "\u00e9".encode() * MIB + b'\xe9"}',
        b"\xff" + b"a" * (2 * MIB),
    ],
    ids=["late-in-content", "after-multibyte", "first-byte"],
)
def test_a_body_that_is_not_utf8_gets_the_same_refusal(raw, matcher):
    verdict = validate_body(raw, matcher)
    [violation] = verdict.violations
    assert (violation.code, violation.param, violation.status) == (
        ErrorCode.INVALID_JSON,
        None,
        400,
    )
    assert violation.message == "the request body is not valid UTF-8"


# ---------------------------------------------------------------- vLLM's part union


def judged_vllm(parts: list[Any], matcher: RuleMatcher, model: str = "qwen2.5-vl"):
    raw = orjson.dumps({"model": model, "messages": [{"role": "user", "content": parts}]})
    return validate_body(raw, matcher, dialect=lambda _rule: VLLM)


# (part, code, param suffix): each refused as it was before parts were indexed by type.
TYPELESS = [
    ({"image_url": ""}, ErrorCode.URL_NOT_ALLOWED, ".image_url"),
    ({"image_url": None}, ErrorCode.INVALID_REQUEST, ".image_url"),
    ({"image_url": 3}, ErrorCode.INVALID_REQUEST, ".image_url"),
    ({"image_url": "", "type": 5}, ErrorCode.INVALID_REQUEST, ".type"),
    ({"foo": 1}, ErrorCode.INVALID_REQUEST, ".type"),
]


@pytest.mark.parametrize(("part", "code", "suffix"), TYPELESS)
def test_a_typeless_vllm_part_gets_the_verdict_it_had(part, code, suffix, matcher):
    for parts in ([part], [part] * 3, [{"type": "text", "text": "a"}, part]):
        verdict = judged_vllm(parts, matcher)
        first = verdict.violations[0]
        index = len(parts) - 1 if parts[0] is not part else 0
        assert (first.code, first.param) == (code, f"messages.[0].content.[{index}]{suffix}")


def _old_message_path(role: str, parts: list[object]) -> tuple[str, int | None]:
    """``message_path`` as it was before e5541a4: every part against all 17 members."""
    matched = [vllm_union.best_match(p, vllm_union.VLLM_PART_UNION) for p in parts]
    roles = vllm_union.OPENAI_MESSAGE_PARTS
    if all(n is not None for n in matched) and (any(matched) or role not in roles):
        return "own", None
    fallback = roles.get(role)
    if fallback is None:
        return "refused", next(i for i, n in enumerate(matched) if n is None)
    for index, p in enumerate(parts):
        if isinstance(p, str) or vllm_union.best_match(p, fallback) is None:
            return "refused", index
    return "openai", None


_PARTS: list[object] = [
    "hello",
    7,
    None,
    {},
    {"image_url": ""},
    {"image_url": None},
    {"image_url": {"url": "https://x/y.png"}},
    {"image_pil": None, "uuid": "u"},
    {"video_url": "https://x/v.mp4"},
    {"audio_url": 1},
    {"name": "tool"},
    {"type": "tool_reference"},
    {"type": "text", "text": "hi"},
    {"type": "text"},
    {"type": "input_text", "text": "hi"},
    {"type": "image_url", "image_url": {"url": "u", "detail": "low"}},
    {"type": "image_url", "image_url": "u"},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "video_embeds", "audio_embeds": {"a": [1, 2.5]}},
    {"type": "prompt_embeds", "data": "AAAA"},
    {"type": "thinking", "thinking": "hmm", "closed": True},
    {"type": "refusal", "refusal": "no"},
    {"type": 5, "image_url": ""},
    {"type": "nothing", "video_url": ""},
]


@pytest.mark.parametrize("role", ["user", "assistant", "system", "tool", "narrator"])
def test_message_path_reads_every_pair_of_parts_as_the_full_scan_did(role):
    for first in _PARTS:
        for second in _PARTS:
            parts = [first, second]
            assert vllm_union.message_path(role, parts) == _old_message_path(role, parts), parts


@pytest.mark.parametrize("part", [{"image_url": ""}, {"image_url": "https://x/y.png"}])
def test_n_typeless_parts_cost_a_few_tries_each_not_seventeen(part, matcher, monkeypatch):
    tries = 0
    original = vllm_union.fields_matched

    def counting(*args):
        nonlocal tries
        tries += 1
        return original(*args)

    monkeypatch.setattr(vllm_union, "fields_matched", counting)
    count = 2_000
    verdict = judged_vllm([part] * count, matcher)
    assert verdict.violations or verdict.accepted  # judged, either way
    assert count <= tries <= 5 * count, tries  # the full scan: 17 * count
