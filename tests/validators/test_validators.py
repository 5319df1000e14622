"""The validators, through ``validate_body`` / ``validate_request``: pure, no I/O, no server.

Every refusal is checked for its exact code, status and param (those are the public
contract clients branch on), and its message for leaked Python internals.
"""

from __future__ import annotations

import re
import struct
import warnings
from typing import Any

import orjson
import pytest

from conftest import (
    MP4_BYTES,
    PDF_BYTES,
    WAV_BYTES,
    animated_gif,
    b64,
    body,
    chat,
    data_url,
    image_bytes,
    image_part,
    png_bomb,
)
from modalgate.errors import MAX_LISTED_VIOLATIONS, STATUS, ErrorCode, error_body
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.settings import EngineSpec
from modalgate.validators import Verdict, validate_body, validate_request
from modalgate.validators.admission import COUNT_MARGIN
from modalgate.validators.dialects import OPENAI, Dialect, dialect_for

P0 = "messages.[0].content.[0]"  # the first part of the first message
PNG = image_bytes("PNG")
JPEG = image_bytes("JPEG")
KIMI_ENCODER_MESSAGE = "Kimi-K3 encoder mode supports image input only"

# What a message must never carry: exception reprs, addresses, stack text, paths.
# vLLM's reading: bare strings, parts without a type, URLs as strings (the default,
# an OpenAI-compatible server, refuses them: tests/validators/test_dialects.py).
VLLM = dialect_for(EngineSpec(name="vllm"))
_INTERNALS = re.compile(
    r"Traceback|\b0x[0-9a-fA-F]+|object at|Error\(|Exception\(|File \"|\.py\b|/work/|site-packages"
    r"|<[A-Za-z_.]+ "
)


def matcher(yaml_text: str, mode: str | None = None) -> RuleMatcher:
    return RuleMatcher(parse_policy(yaml_text, fmt="yaml"), mode)


def clean(message: str) -> bool:
    return isinstance(message, str) and message != "" and not _INTERNALS.search(message)


def refused(
    verdict: Verdict, code: ErrorCode, param: str | None, status: int | None = None
) -> None:
    """The first violation is exactly (code, param), with the catalogue's status."""
    assert not verdict.accepted, "expected a refusal, got an accepted verdict"
    first = verdict.violations[0]
    assert first.code is code, (first.code, first.message)
    assert first.param == param, (first.param, first.message)
    expected_status = STATUS[code] if status is None else status
    assert first.status == expected_status
    assert verdict.status == expected_status
    for violation in verdict.violations:
        assert clean(violation.message), violation.message
    envelope = error_body(verdict.violations)["error"]
    assert envelope["code"] == code.value and envelope["param"] == param


def check(
    request: Any, m: RuleMatcher, code: ErrorCode, param: str | None, dialect: Dialect = OPENAI
) -> Verdict:
    verdict = validate_body(body(request), m, dialect=lambda _rule: dialect)
    refused(verdict, code, param)
    return verdict


def accepted(request: Any, m: RuleMatcher, dialect: Dialect = OPENAI) -> Verdict:
    verdict = validate_body(body(request), m, dialect=lambda _rule: dialect)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    assert verdict.status == 200
    return verdict


def wrapped(text: str, width: int = 76) -> str:
    return "\n".join(text[i : i + width] for i in range(0, len(text), width))


# ---------------------------------------------------------------- the body itself


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"{not json", id="invalid"),
        pytest.param(b'{"model": "kimi-k3",', id="cut-short"),
        pytest.param(b"", id="empty"),
        pytest.param(b"   \n\t ", id="whitespace"),
        pytest.param(b"\xff\xfe{}", id="not-utf8"),
        pytest.param(b'{"model": "kimi-\xff"}', id="not-utf8-in-string"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'[{"model": "kimi-k3"}]', id="array-of-object"),
        pytest.param(b'"a string"', id="string"),
        pytest.param(b"42", id="number"),
        pytest.param(b"3.5", id="float"),
        pytest.param(b"null", id="null"),
        pytest.param(b"true", id="bool"),
        pytest.param(b"[" * 5000, id="deep-unterminated"),
        pytest.param(b"[" * 5000 + b"]" * 5000, id="deep-array"),
        pytest.param(
            b'{"model": "kimi-k3", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", id="deep-in-object"
        ),
        pytest.param(b'{"a":' * 5000 + b"1" + b"}" * 5000, id="deep-objects"),
    ],
)
def test_body_that_is_not_a_json_object(raw, encoder_matcher):
    verdict = validate_body(raw, encoder_matcher)
    refused(verdict, ErrorCode.INVALID_JSON, None, 400)
    assert verdict.parts == ()


def test_deep_nesting_is_named(encoder_matcher):
    verdict = validate_body(b"[" * 5000 + b"]" * 5000, encoder_matcher)
    assert "nested too deeply" in verdict.violations[0].message


def test_json_error_message_gives_position_not_internals(encoder_matcher):
    verdict = validate_body(b'{"model": kimi}', encoder_matcher)
    refused(verdict, ErrorCode.INVALID_JSON, None)
    assert "line 1" in verdict.violations[0].message


# ---------------------------------------------------------------- request shape


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        pytest.param({"model": 7, "messages": [{"role": "user", "content": "hi"}]}, "model"),
        pytest.param({"model": ["kimi-k3"], "messages": []}, "model", id="model-list"),
        pytest.param({"model": "kimi-k3"}, "messages", id="messages-missing"),
        pytest.param({"model": "kimi-k3", "messages": None}, "messages", id="messages-null"),
        pytest.param({"model": "kimi-k3", "messages": "hi"}, "messages", id="messages-str"),
        pytest.param({"model": "kimi-k3", "messages": {"0": {}}}, "messages", id="messages-obj"),
        pytest.param({"model": "kimi-k3", "messages": []}, "messages", id="messages-empty"),
        pytest.param({"model": "kimi-k3", "messages": ["hi"]}, "messages.[0]", id="msg-str"),
        pytest.param({"model": "kimi-k3", "messages": [None]}, "messages.[0]", id="msg-null"),
        pytest.param(
            {"model": "kimi-k3", "messages": [{"role": 1, "content": "hi"}]},
            "messages.[0].role",
            id="role-int",
        ),
        pytest.param(
            {"model": "kimi-k3", "messages": [{"content": "hi"}]},
            "messages.[0].role",
            id="role-missing",
        ),
        pytest.param(
            {"model": "kimi-k3", "messages": [{"role": "user", "content": 5}]},
            "messages.[0].content",
            id="content-number",
        ),
        pytest.param(
            {"model": "kimi-k3", "messages": [{"role": "user", "content": {"type": "text"}}]},
            "messages.[0].content",
            id="content-object",
        ),
        pytest.param(
            {"model": "kimi-k3", "messages": [{"role": "user"}]},
            "messages.[0].content",
            id="user-content-missing",
        ),
        pytest.param(
            {"model": "kimi-k3", "messages": [{"role": "user", "content": []}]},
            "messages.[0].content",
            id="user-content-empty-array",
        ),
        pytest.param(chat(5), P0, id="part-number"),
        pytest.param(chat(None), P0, id="part-null"),
        pytest.param(chat(["text"]), P0, id="part-list"),
        pytest.param(chat({"type": 3, "text": "x"}), f"{P0}.type", id="type-int"),
        pytest.param(chat({"type": None, "x": 1}), f"{P0}.type", id="type-null-no-key"),
        pytest.param(chat({"text": "x"}), f"{P0}.type", id="type-missing"),
        pytest.param(chat({"type": "text", "text": 5}), f"{P0}.text", id="text-int"),
        pytest.param(chat({"type": "text"}), f"{P0}.text", id="text-missing"),
        pytest.param(chat({"type": "input_text", "text": None}), f"{P0}.text", id="input-text"),
        pytest.param(chat({"type": "image_url"}), f"{P0}.image_url", id="image_url-missing"),
        pytest.param(chat({"type": "image_url", "image_url": 5}), f"{P0}.image_url", id="iu-int"),
        pytest.param(
            chat({"type": "image_url", "image_url": ["https://example.com/a.png"]}),
            f"{P0}.image_url",
            id="image_url-list",
        ),
        pytest.param(
            chat({"type": "image_url", "image_url": {"url": 5}}),
            f"{P0}.image_url.url",
            id="url-int",
        ),
        pytest.param(
            chat({"type": "image_url", "image_url": {}}), f"{P0}.image_url.url", id="url-missing"
        ),
        pytest.param(
            chat({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "ultra"}}),
            f"{P0}.image_url.detail",
            id="detail-unknown",
        ),
        pytest.param(
            chat({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": 1}}),
            f"{P0}.image_url.detail",
            id="detail-int",
        ),
        pytest.param(
            chat({"type": "input_audio", "input_audio": {"format": "wav"}}),
            f"{P0}.input_audio",
            id="input_audio-no-data",
        ),
        pytest.param(
            chat({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}),
            f"{P0}.input_audio",
            id="input_audio-data-int",
        ),
        pytest.param(
            chat({"type": "input_audio", "input_audio": "AAAA"}),
            f"{P0}.input_audio",
            id="input_audio-str",
        ),
        pytest.param(
            chat({"type": "input_audio", "input_audio": {"data": b64(WAV_BYTES)}}),
            f"{P0}.input_audio.format",
            id="input_audio-no-format",
        ),
    ],
)
def test_ill_typed_fields(request_, param, encoder_matcher):
    # Shape is checked before modality: an ill-formed audio part is a shape error even
    # for a model that would refuse audio.
    check(request_, encoder_matcher, ErrorCode.INVALID_REQUEST, param)


def test_assistant_may_send_an_empty_content_array(encoder_matcher):
    accepted(
        {"model": "kimi-k3", "messages": [{"role": "assistant", "content": []}]}, encoder_matcher
    )


def test_assistant_and_tool_may_omit_content(encoder_matcher):
    request = {
        "model": "kimi-k3",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": []},
        ],
    }
    accepted(request, encoder_matcher)


def test_bare_string_parts_are_text(encoder_matcher):
    accepted(chat("hello", {"type": "text", "text": "world"}), encoder_matcher, VLLM)


def test_param_points_at_the_right_message_and_part(encoder_matcher):
    request = {
        "model": "kimi-k3",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]},
        ],
    }
    check(request, encoder_matcher, ErrorCode.INVALID_REQUEST, "messages.[1].content.[1].text")


def test_several_shape_problems_are_all_listed(encoder_matcher):
    request = chat({"type": "text", "text": 1}, 5, {"type": "nope"})
    verdict = check(request, encoder_matcher, ErrorCode.INVALID_REQUEST, f"{P0}.text")
    assert [(v.code, v.param) for v in verdict.violations] == [
        (ErrorCode.INVALID_REQUEST, f"{P0}.text"),
        (ErrorCode.INVALID_REQUEST, "messages.[0].content.[1]"),
        (ErrorCode.UNSUPPORTED_CONTENT_TYPE, "messages.[0].content.[2].type"),
    ]


# ---------------------------------------------------------------- part types


@pytest.mark.parametrize(
    "part_type", ["video", "image", "input_video", "IMAGE_URL", "image_url ", "", "x" * 500]
)
def test_unknown_part_type(part_type, encoder_matcher):
    verdict = check(
        chat({"type": part_type, "image_url": {"url": data_url(PNG)}}),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_CONTENT_TYPE,
        f"{P0}.type",
    )
    assert len(verdict.violations[0].message) < 300  # a huge type name is cut short


def test_image_pil_is_never_valid_over_http(encoder_matcher):
    verdict = check(
        chat({"type": "image_pil", "image_pil": "<PIL.Image>"}),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_CONTENT_TYPE,
        f"{P0}.type",
    )
    assert "image_url" in verdict.violations[0].message


def test_typeless_image_pil_is_refused(encoder_matcher):
    verdict = validate_body(body(chat({"image_pil": "x"})), encoder_matcher, dialect=lambda _: VLLM)
    assert verdict.violations[0].code is ErrorCode.UNSUPPORTED_CONTENT_TYPE


def test_typeless_video_part_is_inferred_as_video(encoder_matcher):
    # vLLM infers a missing type from the payload key; with no `type`, the key is blamed.
    verdict = check(
        chat({"video_url": "https://example.com/v.mp4"}),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"{P0}.video_url",
        VLLM,
    )
    assert KIMI_ENCODER_MESSAGE in verdict.violations[0].message


def test_typeless_image_part_is_inferred_as_image(encoder_matcher):
    # alone, vLLM reads such a message as OpenAI's and refuses it: a text part beside it
    verdict = accepted(
        chat({"type": "text", "text": "x"}, {"image_url": {"url": data_url(PNG)}}),
        encoder_matcher,
        VLLM,
    )
    assert verdict.parts[0].modality == "image"


@pytest.mark.parametrize(
    ("declared", "smuggled", "payload", "blamed"),
    [
        # With a uuid, vLLM reads the payload key and SGLang the type: they must agree.
        ("text", "video_url", {"url": "https://example.com/v.mp4"}, "type"),
        ("text", "audio_url", {"url": "https://example.com/a.wav"}, "type"),
        ("text", "video_embeds", "AAAA", "type"),
        ("text", "input_audio", {"data": b64(WAV_BYTES), "format": "wav"}, "type"),
        # The key vLLM reads first agrees with the type; the second payload is refused.
        ("image_url", "video_url", {"url": "https://example.com/v.mp4"}, "video_url"),
    ],
)
def test_part_carrying_a_second_payload_is_refused(
    declared, smuggled, payload, blamed, encoder_matcher
):
    part = {"type": declared, "uuid": "1", smuggled: payload}
    if declared == "text":
        part["text"] = "x"
    else:
        part[declared] = {"url": data_url(PNG)}
    check(chat(part), encoder_matcher, ErrorCode.INVALID_REQUEST, f"{P0}.{blamed}")


# ---------------------------------------------------------------- modalities


NON_IMAGE_PARTS = {
    "video_url": {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    "video_url-data": {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}},
    "audio_url": {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
    "input_audio": {
        "type": "input_audio",
        "input_audio": {"data": b64(WAV_BYTES), "format": "wav"},
    },
    "file": {"type": "file", "file": {"file_data": data_url(PDF_BYTES, "application/pdf")}},
    "file_id": {"type": "file", "file": {"file_id": "file-abc"}},
    "input_file": {"type": "input_file", "file_data": data_url(PDF_BYTES, "application/pdf")},
    "image_embeds": {"type": "image_embeds", "image_embeds": "AAAA"},
}


@pytest.mark.parametrize("name", list(NON_IMAGE_PARTS))
@pytest.mark.parametrize("index", [0, 2])
def test_kimi_k3_encoder_refuses_non_image_parts(name, index, encoder_matcher):
    parts: list[Any] = [{"type": "text", "text": "look"}, image_part(data_url(PNG))][:index]
    parts.append(NON_IMAGE_PARTS[name])
    verdict = check(
        chat(*parts),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"messages.[0].content.[{index}].type",
    )
    assert KIMI_ENCODER_MESSAGE in verdict.violations[0].message


def test_kimi_k3_encoder_reports_every_refused_part(encoder_matcher):
    parts = [image_part(data_url(PNG)), *NON_IMAGE_PARTS.values()]
    verdict = validate_body(body(chat(*parts)), encoder_matcher)
    assert [v.param for v in verdict.violations] == [
        f"messages.[0].content.[{i}].type" for i in range(1, len(parts))
    ]
    assert all(v.code is ErrorCode.UNSUPPORTED_MODALITY for v in verdict.violations)


@pytest.mark.parametrize("model", ["kimi-k3", "moonshotai/Kimi-K3-Instruct", "KIMI-K3"])
def test_kimi_k3_aliases_resolve_to_the_encoder_rule(model, encoder_matcher):
    verdict = check(
        chat(NON_IMAGE_PARTS["video_url"], model=model),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"{P0}.type",
    )
    assert KIMI_ENCODER_MESSAGE in verdict.violations[0].message


def test_kimi_k3_full_mode_has_its_own_message(full_matcher):
    verdict = check(
        chat(NON_IMAGE_PARTS["video_url"]),
        full_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"{P0}.type",
    )
    assert "Kimi-K3 supports image input only" in verdict.violations[0].message
    assert "encoder mode" not in verdict.violations[0].message


@pytest.mark.parametrize(
    ("modality", "part"),
    [
        ("video", NON_IMAGE_PARTS["video_url"]),
        ("audio", NON_IMAGE_PARTS["audio_url"]),
        ("audio", NON_IMAGE_PARTS["input_audio"]),
        ("file", NON_IMAGE_PARTS["file"]),
    ],
)
def test_rule_without_message_names_modality_model_and_accepts(modality, part, full_matcher):
    verdict = check(
        chat(part, model="pixtral-12b"), full_matcher, ErrorCode.UNSUPPORTED_MODALITY, f"{P0}.type"
    )
    message = verdict.violations[0].message
    assert f"{modality} input is not supported by pixtral-12b" in message
    assert "(accepts: image)" in message


def test_rule_without_message_names_the_mode(encoder_matcher):
    verdict = check(
        chat(NON_IMAGE_PARTS["audio_url"], model="kimi-k2.5"),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"{P0}.type",
    )
    message = verdict.violations[0].message
    assert "audio input is not supported by kimi-k2.5 in encoder mode" in message
    assert "(accepts: image, video)" in message


def test_text_only_model_refuses_images(full_matcher):
    verdict = check(
        chat(image_part(data_url(PNG)), model="google/gemma-3-1b-it"),
        full_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"{P0}.type",
    )
    assert "Gemma 3 1B is a text-only model" in verdict.violations[0].message


def test_video_model_accepts_video(full_matcher):
    verdict = accepted(chat(NON_IMAGE_PARTS["video_url-data"], model="kimi-k2.5"), full_matcher)
    facts = verdict.parts[0].facts()
    assert (facts["modality"], facts["format"]) == ("video", "mp4")


def test_audio_model_accepts_input_audio(full_matcher):
    verdict = accepted(chat(NON_IMAGE_PARTS["input_audio"], model="qwen2-audio"), full_matcher)
    facts = verdict.parts[0].facts()
    assert (facts["modality"], facts["format"], facts["bytes"]) == ("audio", "wav", len(WAV_BYTES))


def test_audio_part_with_image_bytes_is_a_mismatch(full_matcher):
    part = {"type": "input_audio", "input_audio": {"data": b64(PNG), "format": "wav"}}
    check(
        chat(part, model="qwen2-audio"),
        full_matcher,
        ErrorCode.MODALITY_MISMATCH,
        f"{P0}.input_audio.data",
    )


# ---------------------------------------------------------------- roles


@pytest.mark.parametrize("role", ["system", "developer", "assistant"])
def test_media_outside_user_messages(role, encoder_matcher):
    request = {
        "model": "kimi-k3",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": role, "content": [{"type": "text", "text": "x"}, image_part(data_url(PNG))]},
        ],
    }
    verdict = check(
        request, encoder_matcher, ErrorCode.ROLE_NOT_ALLOWED, "messages.[1].content.[1]"
    )
    assert f"'{role}'" in verdict.violations[0].message


def test_policy_can_allow_media_in_other_roles():
    m = matcher(
        "models:\n  - name: vlm\n    accepts: [image]\n    media_roles: [user, assistant]\n"
    )
    accepted(chat(image_part(data_url(PNG)), model="vlm", role="assistant"), m)
    check(
        chat(image_part(data_url(PNG)), model="vlm", role="system"),
        m,
        ErrorCode.ROLE_NOT_ALLOWED,
        P0,
    )


# ---------------------------------------------------------------- counts


def test_sixteen_images_are_fine_seventeen_are_not(encoder_matcher):
    png = data_url(PNG)
    accepted(chat(*[image_part(png)] * 16), encoder_matcher)
    verdict = check(
        chat(*[image_part(png)] * 17),
        encoder_matcher,
        ErrorCode.TOO_MANY_MEDIA,
        "messages.[0].content.[16]",
    )
    message = verdict.violations[0].message
    assert "17" in message and "16" in message


def test_image_count_spans_messages(encoder_matcher):
    png = data_url(PNG)
    request = {
        "model": "kimi-k3",
        "messages": [
            {"role": "user", "content": [image_part(png)] * 10},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [image_part(png)] * 7},
        ],
    }
    check(request, encoder_matcher, ErrorCode.TOO_MANY_MEDIA, "messages.[2].content.[6]")


def test_ten_thousand_text_parts_are_accepted(encoder_matcher):
    verdict = accepted(chat(*[{"type": "text", "text": "x"}] * 10_000), encoder_matcher)
    assert verdict.parts == ()


def test_ten_thousand_images_are_too_many(encoder_matcher):
    verdict = check(
        chat(*[image_part(data_url(PNG))] * 10_000),
        encoder_matcher,
        ErrorCode.TOO_MANY_MEDIA,
        "messages.[0].content.[16]",
    )
    assert len(verdict.violations) <= MAX_LISTED_VIOLATIONS
    # The walk stops COUNT_MARGIN images past the limit: the rest are never read.
    assert len(verdict.parts) == 16 + COUNT_MARGIN + 1
    assert verdict.violations[0].message == (
        "messages.[0].content.[16]: too many images: more than 80 sent,"
        " at most 16 allowed for kimi-k3"
    )
    assert all(part.data is None for part in verdict.parts)  # nothing was decoded


def test_a_count_within_the_margin_is_told_exactly(encoder_matcher):
    verdict = check(
        chat(*[image_part(data_url(PNG))] * (16 + COUNT_MARGIN)),
        encoder_matcher,
        ErrorCode.TOO_MANY_MEDIA,
        "messages.[0].content.[16]",
    )
    assert verdict.violations[0].message == (
        "messages.[0].content.[16]: too many images: 80 sent, at most 16 allowed for kimi-k3"
    )


def test_ten_thousand_refused_parts_list_at_most_the_cap(encoder_matcher):
    verdict = check(
        chat(*[NON_IMAGE_PARTS["video_url"]] * 10_000),
        encoder_matcher,
        ErrorCode.UNSUPPORTED_MODALITY,
        f"{P0}.type",
    )
    assert len(verdict.violations) <= MAX_LISTED_VIOLATIONS
    assert len(error_body(verdict.violations)["error"]["violations"]) <= MAX_LISTED_VIOLATIONS


def test_ten_thousand_bad_messages_list_at_most_the_cap(encoder_matcher):
    request = {"model": "kimi-k3", "messages": [5] * 10_000}
    verdict = check(request, encoder_matcher, ErrorCode.INVALID_REQUEST, "messages.[0]")
    assert len(verdict.violations) <= MAX_LISTED_VIOLATIONS


def test_per_modality_count_limit():
    m = matcher("models:\n  - name: vm\n    accepts: [image, video]\n    limits: {max_videos: 1}\n")
    video = NON_IMAGE_PARTS["video_url"]
    accepted(chat(video, model="vm"), m)
    check(
        chat(video, image_part(data_url(PNG)), video, model="vm"),
        m,
        ErrorCode.TOO_MANY_MEDIA,
        "messages.[0].content.[2]",
    )


# ---------------------------------------------------------------- base64 and data URLs

URL = f"{P0}.image_url.url"


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("data:image/png;base64,iVBO!!!!", id="bad-characters"),
        pytest.param("data:image/png;base64,iVBO\x00RK5C", id="nul"),
        pytest.param("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAE", id="wrong-length"),
        pytest.param("data:image/png;base64,a", id="one-char"),
        pytest.param("data:image/png;base64,=AAA", id="leading-padding"),
        pytest.param("data:image/png;base64,iVBORw0KGgo=é", id="non-ascii"),
        pytest.param("data:image/png,abc", id="not-base64-data-url"),
        pytest.param("data:image/png;charset=utf-8,abc", id="not-base64-with-param"),
        pytest.param("data:,abc", id="no-mime-not-base64"),
    ],
)
def test_invalid_base64(url, encoder_matcher):
    check(chat(image_part(url)), encoder_matcher, ErrorCode.INVALID_BASE64, URL)


def test_empty_base64_payload_is_not_an_image(encoder_matcher):
    # "" is valid base64 for zero bytes; zero bytes are no image.
    check(chat(image_part("data:image/png;base64,")), encoder_matcher, ErrorCode.INVALID_IMAGE, URL)


def test_line_wrapped_base64_is_accepted(encoder_matcher):
    png = image_bytes("PNG", size=(300, 300))
    url = "data:image/png;base64," + wrapped(b64(png))
    assert "\n" in url
    verdict = accepted(chat(image_part(url)), encoder_matcher)
    facts = verdict.parts[0].facts()
    assert (facts["format"], facts["width"], facts["height"]) == ("png", 300, 300)
    assert facts["bytes"] == len(png)


def test_line_wrapped_base64_counts_decoded_bytes_against_the_limit():
    # An image of exactly max_image_bytes is within the limit however its base64 is wrapped.
    png = image_bytes("PNG", size=(300, 300))
    m = matcher(f"limits:\n  max_image_bytes: {len(png)}\n")
    accepted(chat(image_part(data_url(png))), m)
    accepted(chat(image_part("data:image/png;base64," + wrapped(b64(png)))), m)
    accepted(chat(image_part("data:image/png;base64," + wrapped(b64(png), 64))), m)


def test_data_url_without_comma_is_malformed(encoder_matcher):
    check(
        chat(image_part("data:image/png;base64" + "A" * 100)),
        encoder_matcher,
        ErrorCode.INVALID_REQUEST,
        URL,
    )


def test_data_url_scheme_is_case_insensitive(encoder_matcher):
    verdict = accepted(chat(image_part("DATA:image/png;BASE64," + b64(PNG))), encoder_matcher)
    assert verdict.parts[0].format == "png"


def test_data_urls_can_be_turned_off():
    m = matcher("media_urls:\n  schemes: [https]\n")
    check(chat(image_part(data_url(PNG))), m, ErrorCode.URL_NOT_ALLOWED, URL)


# ---------------------------------------------------------------- image bytes


def half(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("data", "mime"),
    [
        pytest.param(half(PNG), "image/png", id="truncated-png"),
        pytest.param(
            half(image_bytes("PNG", size=(300, 300))), "image/png", id="truncated-png-big"
        ),
        pytest.param(half(JPEG), "image/jpeg", id="truncated-jpeg"),
        pytest.param(half(image_bytes("JPEG", size=(800, 600))), "image/jpeg", id="trunc-jpeg-big"),
        pytest.param(half(image_bytes("WEBP")), "image/webp", id="truncated-webp"),
        pytest.param(image_bytes("GIF")[:-8], "image/gif", id="truncated-gif"),
        pytest.param(PNG[:8], "image/png", id="png-signature-only"),
        pytest.param(
            b"\x89PNG\r\n\x1a\n" + b"\x00" * 40 + b"IEND\xaeB`\x82", "image/png", id="png-hollow"
        ),
        pytest.param(
            b"\xff\xd8\xff\xe0" + b"\x00" * 40 + b"\xff\xd9", "image/jpeg", id="jpeg-hollow"
        ),
        pytest.param(b"this is not an image at all", "image/png", id="text"),
        pytest.param(bytes(range(256)) * 4, "image/jpeg", id="garbage"),
        pytest.param(b"\x00" * 64, "image/webp", id="zeros"),
        pytest.param(b"GIF89a" + b"\x00" * 20 + b";", "image/gif", id="gif-hollow"),
        pytest.param(png_bomb(0, 10), "image/png", id="png-zero-width"),
    ],
)
def test_invalid_image(data, mime, encoder_matcher):
    check(chat(image_part(data_url(data, mime))), encoder_matcher, ErrorCode.INVALID_IMAGE, URL)


def test_decompression_bomb_is_refused_from_the_header(encoder_matcher):
    bomb = png_bomb(100_000, 100_000)
    verdict = check(
        chat(image_part(data_url(bomb))), encoder_matcher, ErrorCode.IMAGE_TOO_LARGE, URL
    )
    message = verdict.violations[0].message
    assert "100000x100000" in message
    assert "10000000000" in message
    assert "51380224" in message
    assert verdict.parts[0].bytes == len(bomb)  # the tiny file itself was under every byte limit


def test_pixel_limit_comes_from_the_policy():
    m = matcher("limits:\n  max_image_pixels: 3000\n")
    accepted(chat(image_part(data_url(image_bytes(size=(60, 50))))), m)
    verdict = check(
        chat(image_part(data_url(image_bytes(size=(64, 48))))), m, ErrorCode.IMAGE_TOO_LARGE, URL
    )
    assert "3072" in verdict.violations[0].message


def test_image_bytes_over_the_model_limit():
    m = matcher(
        "models:\n"
        "  - name: tiny\n"
        "    accepts: [image]\n"
        f"    limits: {{max_image_bytes: {len(PNG) - 1}}}\n"
    )
    verdict = check(
        chat(image_part(data_url(PNG)), model="tiny"), m, ErrorCode.IMAGE_TOO_LARGE, URL
    )
    assert f"{len(PNG)} bytes" in verdict.violations[0].message
    # The limit belongs to the model: others keep the default.
    accepted(chat(image_part(data_url(PNG)), model="other"), m)
    # And exactly at the limit is fine.
    m_exact = matcher(
        "models:\n"
        "  - name: tiny\n"
        "    accepts: [image]\n"
        f"    limits: {{max_image_bytes: {len(PNG)}}}\n"
    )
    accepted(chat(image_part(data_url(PNG)), model="tiny"), m_exact)


def test_oversized_image_is_refused_before_decoding():
    m = matcher("limits:\n  max_image_bytes: 10\n")
    verdict = check(chat(image_part(data_url(PNG))), m, ErrorCode.IMAGE_TOO_LARGE, URL)
    assert verdict.parts[0].data is None


def test_one_pixel_image_is_too_small(encoder_matcher, builtin_policy):
    assert builtin_policy.limits.min_image_side == 2
    verdict = check(
        chat(image_part(data_url(image_bytes(size=(1, 1))))),
        encoder_matcher,
        ErrorCode.IMAGE_TOO_SMALL,
        URL,
    )
    assert "1x1" in verdict.violations[0].message
    accepted(chat(image_part(data_url(image_bytes(size=(2, 2))))), encoder_matcher)


def test_min_side_from_a_custom_policy():
    m = matcher("limits:\n  min_image_side: 2\n")
    check(chat(image_part(data_url(image_bytes(size=(1, 40))))), m, ErrorCode.IMAGE_TOO_SMALL, URL)


@pytest.mark.parametrize("model", ["qwen2.5-vl", "Qwen/Qwen2.5-VL-7B-Instruct"])
def test_qwen25_vl_needs_28_pixel_sides(model, full_matcher):
    verdict = check(
        chat(image_part(data_url(image_bytes(size=(27, 100)))), model=model),
        full_matcher,
        ErrorCode.IMAGE_TOO_SMALL,
        URL,
    )
    assert "28" in verdict.violations[0].message
    accepted(chat(image_part(data_url(image_bytes(size=(28, 28)))), model=model), full_matcher)


def test_animated_gif_is_refused(encoder_matcher):
    verdict = check(
        chat(image_part(data_url(animated_gif(3), "image/gif"))),
        encoder_matcher,
        ErrorCode.ANIMATED_IMAGE,
        URL,
    )
    assert "more than one frame" in verdict.violations[0].message


def test_animated_gif_allowed_by_policy():
    m = matcher("limits:\n  allow_animated: true\n")
    verdict = accepted(chat(image_part(data_url(animated_gif(3), "image/gif"))), m)
    assert verdict.parts[0].frames == 3


def test_still_gif_is_accepted(encoder_matcher):
    verdict = accepted(chat(image_part(data_url(animated_gif(1), "image/gif"))), encoder_matcher)
    assert (verdict.parts[0].format, verdict.parts[0].frames) == ("gif", 1)


@pytest.mark.parametrize(
    ("fmt", "name"), [("BMP", "BMP"), ("TIFF", "TIFF"), ("ICO", "ICO")], ids=["bmp", "tiff", "ico"]
)
def test_formats_outside_the_list(fmt, name, encoder_matcher):
    raw = image_bytes(fmt, size=(32, 32))
    verdict = check(
        chat(image_part(data_url(raw))), encoder_matcher, ErrorCode.UNSUPPORTED_IMAGE_FORMAT, URL
    )
    assert name in verdict.violations[0].message


def test_hostile_tiff_is_refused_without_pillow_warnings():
    # A real TIFF whose next-IFD offset points at the last byte: Pillow warns
    # "Corrupt EXIF data" while counting frames. The refusal must not leak that warning.
    tiff = bytearray(image_bytes("TIFF", size=(8, 8)))
    ifd = struct.unpack("<I", tiff[4:8])[0]
    entries = struct.unpack("<H", tiff[ifd : ifd + 2])[0]
    next_ifd = ifd + 2 + 12 * entries
    tiff[next_ifd : next_ifd + 4] = struct.pack("<I", len(tiff) - 1)
    m = matcher("limits:\n  image_formats: [png, tiff]\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = validate_body(body(chat(image_part(data_url(bytes(tiff), "image/tiff")))), m)
    refused(verdict, ErrorCode.INVALID_IMAGE, URL)
    assert [str(w.message) for w in caught] == []


def test_formats_can_be_opted_in():
    m = matcher("limits:\n  image_formats: [png, bmp, tiff]\n")
    for fmt in ("BMP", "TIFF"):
        verdict = accepted(chat(image_part(data_url(image_bytes(fmt)))), m)
        assert verdict.parts[0].format == fmt.lower()
    check(chat(image_part(data_url(JPEG))), m, ErrorCode.UNSUPPORTED_IMAGE_FORMAT, URL)


# ---------------------------------------------------------------- declared vs actual


@pytest.mark.parametrize(
    ("data", "mime", "what"),
    [
        pytest.param(MP4_BYTES, "image/png", "video", id="mp4-as-png"),
        pytest.param(MP4_BYTES, "image/jpeg", "video", id="mp4-as-jpeg"),
        pytest.param(WAV_BYTES, "image/png", "audio", id="wav-as-png"),
        pytest.param(PDF_BYTES, "image/png", "document", id="pdf-as-png"),
        pytest.param(MP4_BYTES, "application/octet-stream", "video", id="mp4-generic-mime"),
        pytest.param(MP4_BYTES, "", "video", id="mp4-no-mime"),
    ],
)
def test_media_bytes_inside_an_image_part(data, mime, what, encoder_matcher):
    url = f"data:{mime};base64,{b64(data)}"
    verdict = check(chat(image_part(url)), encoder_matcher, ErrorCode.MODALITY_MISMATCH, URL)
    assert what in verdict.violations[0].message


@pytest.mark.parametrize("mime", ["video/mp4", "audio/wav", "application/pdf", "text/plain"])
def test_mime_that_lies_across_modalities(mime, encoder_matcher):
    check(chat(image_part(data_url(PNG, mime))), encoder_matcher, ErrorCode.MODALITY_MISMATCH, URL)


def test_image_bytes_in_a_video_part(full_matcher):
    part = {"type": "video_url", "video_url": {"url": data_url(PNG, "video/mp4")}}
    check(
        chat(part, model="kimi-k2.5"),
        full_matcher,
        ErrorCode.MODALITY_MISMATCH,
        f"{P0}.video_url.url",
    )


@pytest.mark.parametrize(
    ("data", "mime", "fmt"),
    [
        (PNG, "image/jpeg", "png"),
        (JPEG, "image/png", "jpeg"),
        (PNG, "image/webp", "png"),
        (PNG, "application/octet-stream", "png"),
        (PNG, "", "png"),
    ],
)
def test_image_mime_need_not_match_the_image_format(data, mime, fmt, encoder_matcher):
    verdict = accepted(chat(image_part(f"data:{mime};base64,{b64(data)}")), encoder_matcher)
    assert verdict.parts[0].format == fmt
    assert verdict.parts[0].mime == (mime or None)


# ---------------------------------------------------------------- remote URLs


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/a.png",
        "ftp://example.com/a.png",
        "file:///etc/passwd",
        "gopher://example.com/",
        "example.com/a.png",
        "//example.com/a.png",
        "https://127.0.0.1/",
        "https://127.0.0.1:8443/a.png",
        "https://127.1/",
        "https://2130706433/",
        "https://0177.0.0.1/",
        "https://0x7f000001/",
        "https://[::1]/",
        "https://[::ffff:127.0.0.1]/",
        "https://[::ffff:7f00:1]/",
        "https://[64:ff9b::7f00:1]/",
        "https://[fe80::1%25eth0]/",
        "https://169.254.169.254/latest/meta-data/",
        "https://100.100.100.200/",
        "https://10.0.0.1/",
        "https://192.168.1.1/",
        "https://172.16.0.1/",
        "https://0.0.0.0/",
        "https://[::]/",
        "https://localhost/",
        "https://LOCALHOST./",
        "https://api.localhost/",
        "https://user:pw@example.com/",
        "https://user@example.com/",
        "https://example.com/a b.png",
        "https://example.com\\@127.0.0.1/",
        "https://",
        "https:///a.png",
        "https://example.com:99999/a.png",  # httpx parses it; a socket cannot connect to it
        "https://example.com:0/a.png",
    ],
)
def test_url_not_allowed(url, encoder_matcher):
    verdict = check(chat(image_part(url)), encoder_matcher, ErrorCode.URL_NOT_ALLOWED, URL)
    assert "127.0.0.1" not in verdict.violations[0].message.replace(URL, "")


@pytest.mark.parametrize(
    "url", ["https://example.com/a.png", "https://EXAMPLE.com/a.png?x=1#f", "https://8.8.8.8/a.png"]
)
def test_https_url_is_accepted_without_a_fetch(url, encoder_matcher):
    verdict = accepted(chat(image_part(url)), encoder_matcher)
    facts = verdict.parts[0].facts()
    assert facts["source"] == "url"
    assert facts["url"] == url
    assert facts["bytes"] is None and facts["width"] is None  # nothing fetched


def test_image_url_as_a_plain_string(encoder_matcher):
    # vLLM reads a part without a type by its key, where the URL may be a plain string
    verdict = accepted(chat({"image_url": "https://example.com/a.png"}), encoder_matcher, VLLM)
    assert verdict.parts[0].url == "https://example.com/a.png"
    check(
        chat({"image_url": "https://127.0.0.1/a.png"}),
        encoder_matcher,
        ErrorCode.URL_NOT_ALLOWED,
        f"{P0}.image_url",
        VLLM,
    )


def test_policy_can_open_http_and_a_private_range():
    m = matcher("media_urls:\n  schemes: [data, https, http]\n  allow_private: ['127.0.0.0/8']\n")
    accepted(chat(image_part("http://127.0.0.1:8080/a.png")), m)
    accepted(chat(image_part("https://localhost/a.png")), m)
    accepted(chat(image_part("http://example.com/a.png")), m)
    # Only the listed range opens up.
    check(chat(image_part("http://10.0.0.1/a.png")), m, ErrorCode.URL_NOT_ALLOWED, URL)
    check(chat(image_part("http://169.254.169.254/")), m, ErrorCode.URL_NOT_ALLOWED, URL)


def test_allow_hosts():
    m = matcher("media_urls:\n  allow_hosts: ['*.example.com', 'cdn.test']\n")
    accepted(chat(image_part("https://img.example.com/a.png")), m)
    accepted(chat(image_part("https://CDN.test/a.png")), m)
    check(chat(image_part("https://evil.com/a.png")), m, ErrorCode.URL_NOT_ALLOWED, URL)


def test_video_url_is_checked_as_a_url(full_matcher):
    part = {"type": "video_url", "video_url": {"url": "https://169.254.169.254/v.mp4"}}
    check(
        chat(part, model="kimi-k2.5"),
        full_matcher,
        ErrorCode.URL_NOT_ALLOWED,
        f"{P0}.video_url.url",
    )


# ---------------------------------------------------------------- accepted verdicts


@pytest.mark.parametrize(
    ("fmt", "mime", "size"),
    [
        ("PNG", "image/png", (64, 48)),
        ("JPEG", "image/jpeg", (31, 17)),
        ("WEBP", "image/webp", (100, 3)),
        ("GIF", "image/gif", (5, 500)),
    ],
)
def test_accepted_verdict_carries_media_facts(fmt, mime, size, encoder_matcher):
    raw = image_bytes(fmt, size=size)
    request = chat({"type": "text", "text": "what is this?"}, image_part(data_url(raw, mime)))
    verdict = accepted(request, encoder_matcher)
    assert len(verdict.parts) == 1
    facts = verdict.parts[0].facts()
    assert facts["param"] == "messages.[0].content.[1]"
    assert facts["type"] == "image_url"
    assert facts["modality"] == "image"
    assert facts["source"] == "data"
    assert facts["mime"] == mime
    assert facts["format"] == fmt.lower()
    assert (facts["width"], facts["height"]) == size
    assert facts["frames"] == 1
    assert facts["bytes"] == len(raw)
    assert verdict.parts[0].data == raw  # decoded once, handed on
    assert verdict.model == "kimi-k3"
    assert verdict.mode == "encoder"
    assert verdict.rule is not None and verdict.rule.name == "kimi-k3-encoder"
    as_dict = verdict.to_dict()
    assert as_dict["accepted"] is True and as_dict["rule"] == "kimi-k3-encoder"
    orjson.dumps(as_dict)


def test_accepted_verdict_keeps_part_order_across_messages(encoder_matcher):
    request = {
        "model": "kimi-k3",
        "messages": [
            {"role": "user", "content": [image_part(data_url(PNG))]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": ["x", image_part(data_url(JPEG, "image/jpeg"))]},
        ],
    }
    verdict = accepted(request, encoder_matcher, VLLM)
    assert [(p.param, p.format) for p in verdict.parts] == [
        ("messages.[0].content.[0]", "png"),
        ("messages.[2].content.[1]", "jpeg"),
    ]


def test_other_fields_pass_untouched(encoder_matcher):
    request = chat(
        image_part(data_url(PNG)), stream=True, temperature=0.2, tools=[{"x": [1, {"y": None}]}]
    )
    verdict = accepted(request, encoder_matcher)
    assert verdict.request == request


def test_validate_request_takes_a_parsed_request(encoder_matcher):
    verdict = validate_request(chat(image_part(data_url(PNG))), encoder_matcher)
    assert verdict.accepted and verdict.parts[0].format == "png"
    verdict = validate_request(chat(NON_IMAGE_PARTS["video_url"]), encoder_matcher)
    refused(verdict, ErrorCode.UNSUPPORTED_MODALITY, f"{P0}.type")


def test_body_cap_per_model():
    m = matcher(
        "models:\n  - name: small\n    accepts: [image]\n    limits: {max_body_bytes: 100}\n"
    )
    request = chat({"type": "text", "text": "x" * 200}, model="small")
    refused(validate_body(body(request), m), ErrorCode.PAYLOAD_TOO_LARGE, None, 413)
    refused(validate_request(request, m, body_size=500), ErrorCode.PAYLOAD_TOO_LARGE, None, 413)
    assert validate_request(request, m).accepted  # no size given: no cap applied


# ---------------------------------------------------------------- unknown models


REJECT_UNKNOWN = "unknown_models: reject\nmodels:\n  - name: known\n    accepts: [image]\n"


def test_unknown_model_rejected_by_policy():
    verdict = check(
        chat(model="no-such-model"), matcher(REJECT_UNKNOWN), ErrorCode.UNKNOWN_MODEL, "model"
    )
    assert verdict.status == 404


@pytest.mark.parametrize(
    "request_",
    [
        {"messages": [{"role": "user", "content": "hi"}]},
        chat(model=""),
        {"model": None, "messages": [{"role": "user", "content": "hi"}]},
    ],
    ids=["missing", "empty", "null"],
)
@pytest.mark.parametrize("policy", [REJECT_UNKNOWN, "unknown_models: allow\n"])
def test_a_request_without_a_model_is_refused_as_openai_does(request_, policy):
    # vLLM would serve its default model and SGLang ignores the name: judged as nothing.
    verdict = check(request_, matcher(policy), ErrorCode.INVALID_REQUEST, "model")
    assert verdict.status == 400
    assert verdict.violations[0].message == "model: 'model' is required"


def test_a_request_without_a_model_is_judged_as_the_default_model():
    policy = "default_model: known\n" + REJECT_UNKNOWN
    verdict = check(
        {"messages": [{"role": "user", "content": [NON_IMAGE_PARTS["video_url"]]}]},
        matcher(policy),
        ErrorCode.UNSUPPORTED_MODALITY,
        "messages.[0].content.[0].type",
    )
    assert verdict.judged_as == "known" and verdict.model is None


def test_unknown_model_allowed_by_policy():
    m = matcher("unknown_models: allow\n")
    verdict = accepted(chat(image_part(data_url(PNG)), model="no-such-model"), m)
    assert verdict.rule is not None and not verdict.rule.known
    accepted(chat(NON_IMAGE_PARTS["video_url"], model="no-such-model"), m)


def test_known_model_under_reject_policy():
    accepted(chat(image_part(data_url(PNG)), model="KNOWN"), matcher(REJECT_UNKNOWN))


def test_unknown_model_in_the_builtin_table_is_allowed_outside_encoder_mode():
    builtin = RuleMatcher(load_policy(), None)
    accepted(chat(NON_IMAGE_PARTS["video_url"], model="some/unlisted-model"), builtin)


def test_unknown_model_is_refused_in_encoder_mode(encoder_matcher):
    # Encoder mode's rules name one model family: an unknown name is not waved through.
    check(
        chat(image_part(data_url(PNG)), model="some/unlisted-model"),
        encoder_matcher,
        ErrorCode.UNKNOWN_MODEL,
        "model",
    )


# ---------------------------------------------------------------- Responses API and files


def test_responses_api_parts_to_gpt_4o(full_matcher):
    pdf = data_url(PDF_BYTES, "application/pdf")
    request = chat(
        {"type": "input_text", "text": "compare"},
        {"type": "input_image", "image_url": data_url(PNG)},
        {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "high"},
        {"type": "input_file", "file_data": pdf, "filename": "a.pdf"},
        {"type": "input_file", "file_id": "file-123"},
        model="gpt-4o",
    )
    verdict = accepted(request, full_matcher)
    facts = [p.facts() for p in verdict.parts]
    assert [(f["param"], f["modality"], f["source"], f["format"]) for f in facts] == [
        ("messages.[0].content.[1]", "image", "data", "png"),
        ("messages.[0].content.[2]", "image", "url", None),
        ("messages.[0].content.[3]", "file", "data", "pdf"),
        ("messages.[0].content.[4]", "file", "file_id", None),
    ]
    assert facts[2]["bytes"] == len(PDF_BYTES)


@pytest.mark.parametrize(
    "file",
    [
        {"file_data": data_url(PDF_BYTES, "application/pdf"), "filename": "a.pdf"},
        {"file_data": b64(PDF_BYTES), "filename": "a.pdf"},
        {"file_id": "file-abc"},
    ],
    ids=["data-url", "bare-base64", "file-id"],
)
def test_openai_file_part_to_gpt_4o(file, full_matcher):
    verdict = accepted(chat({"type": "file", "file": file}, model="gpt-4o"), full_matcher)
    assert verdict.parts[0].modality == "file"


def test_file_part_with_bad_base64(full_matcher):
    part = {"type": "file", "file": {"file_data": "not base64!"}}
    check(
        chat(part, model="gpt-4o"), full_matcher, ErrorCode.INVALID_BASE64, f"{P0}.file.file_data"
    )


def test_file_part_without_data_or_id(full_matcher):
    check(
        chat({"type": "file", "file": {"filename": "a.pdf"}}, model="gpt-4o"),
        full_matcher,
        ErrorCode.INVALID_REQUEST,
        f"{P0}.file.file_data",
    )


@pytest.mark.parametrize("matcher_name", ["encoder_matcher", "full_matcher"])
def test_file_part_to_kimi_k3(matcher_name, request):
    m = request.getfixturevalue(matcher_name)
    part = {"type": "file", "file": {"file_data": data_url(PDF_BYTES, "application/pdf")}}
    verdict = check(chat(part), m, ErrorCode.UNSUPPORTED_MODALITY, f"{P0}.type")
    assert "image input only" in verdict.violations[0].message


def test_input_image_bad_detail(full_matcher):
    part = {"type": "input_image", "image_url": data_url(PNG), "detail": "max"}
    check(chat(part, model="gpt-4o"), full_matcher, ErrorCode.INVALID_REQUEST, f"{P0}.detail")


def test_input_image_checks_its_bytes(full_matcher):
    part = {"type": "input_image", "image_url": data_url(MP4_BYTES)}
    check(chat(part, model="gpt-4o"), full_matcher, ErrorCode.MODALITY_MISMATCH, f"{P0}.image_url")


def test_avif_can_be_opted_in_and_heif_is_refused():
    m = matcher("limits:\n  image_formats: [png, avif]\n")
    verdict = accepted(chat(image_part(data_url(image_bytes("AVIF", (40, 30)), "image/avif"))), m)
    assert (verdict.parts[0].format, verdict.parts[0].width) == ("avif", 40)
    heif = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 32
    check(
        chat(image_part(data_url(heif, "image/heic"))), m, ErrorCode.UNSUPPORTED_IMAGE_FORMAT, URL
    )


def test_every_part_shape_but_text_has_its_reader():
    from typing import get_args

    from modalgate.validators.parts import _SHAPE_READERS, Shape

    assert set(_SHAPE_READERS) == set(get_args(Shape)) - {"text"}
