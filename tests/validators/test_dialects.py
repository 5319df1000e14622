"""Engine dialects: each shape an engine refuses gets the gate's own 400 naming the part,
each shape it takes passes, and docs/policy.md's table is the one the data makes."""

from __future__ import annotations

from typing import Any

import pytest
from av_media import make_audio

from conformance.dialect_table import committed, render
from conftest import b64, body, chat, data_url, image_bytes
from media_stubs import WAV_BYTES
from modalgate.errors import ErrorCode
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.settings import EngineSpec
from modalgate.validators import Verdict, validate_body
from modalgate.validators.dialects import OPENAI, SGLANG, Dialect, dialect_for
from modalgate.validators.parts import PART_KINDS

PNG = data_url(image_bytes("PNG"))
VIDEO = "https://example.com/v.mp4"
VLLM = dialect_for(EngineSpec(name="vllm"))
VLLM_EMBEDS = dialect_for(EngineSpec(name="vllm", enable_mm_embeds=True))
VLLM_TRUSTING = dialect_for(EngineSpec(name="vllm", trust_request_mm_kwargs=True))
DIALECTS = {
    "openai": OPENAI,
    "vllm": VLLM,
    "vllm+mm-embeds": VLLM_EMBEDS,
    "vllm+prompt-embeds": dialect_for(EngineSpec(name="vllm", enable_prompt_embeds=True)),
    "sglang": SGLANG,
}
POLICY = """
extends: builtin
models:
  - name: omni
    accepts: [image, video, audio, embeddings]
  - name: on-sglang
    accepts: [image]
    engine: sglang
  - name: on-vllm-embeds
    accepts: [image, embeddings]
    engine: {name: vllm, enable_mm_embeds: true}
"""
P0 = "messages.[0].content.[0]"
TEXT = {"type": "text", "text": "describe"}


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(parse_policy(POLICY, fmt="yaml"))


def judged(request: dict[str, Any], matcher: RuleMatcher, dialect: Dialect | None) -> Verdict:
    of = None if dialect is None else (lambda _rule: dialect)
    return validate_body(body(request), matcher, dialect=of)


def image(**extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": PNG, **extra}}


def audio(fmt: str) -> dict[str, Any]:
    """Real audio of the named format: the format given must be the bytes' own."""
    data = FLAC_BYTES if fmt == "flac" else WAV_BYTES
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


FLAC_BYTES = make_audio("flac", seconds=0.1)


# (engine, request, param blamed): each refused with 400 invalid_request.
REFUSED = [
    ("openai", chat({"image_url": {"url": PNG}}, model="omni"), f"{P0}.type"),
    ("sglang", chat({"image_url": PNG}, model="omni"), f"{P0}.type"),
    ("openai", chat({"type": "image_url", "image_url": PNG}, model="omni"), f"{P0}.image_url"),
    (
        "vllm",
        chat(TEXT, {"type": "video_url", "video_url": VIDEO}, model="omni"),
        "messages.[0].content.[1].video_url",
    ),
    ("sglang", chat({"type": "image_url", "image_url": PNG}, model="omni"), f"{P0}.image_url"),
    ("vllm", chat(image(detail="default"), model="omni"), f"{P0}.image_url.detail"),
    ("sglang", chat(image(detail="original"), model="omni"), f"{P0}.image_url.detail"),
    ("vllm", chat(image(detail=None), model="omni"), f"{P0}.image_url.detail"),
    ("openai", chat(audio("flac"), model="omni"), f"{P0}.input_audio.format"),
    ("sglang", chat(audio("WAV"), model="omni"), f"{P0}.input_audio.format"),
    ("vllm", chat({"type": "file", "file": {"file_id": "f"}}, model="omni"), f"{P0}.type"),
    ("sglang", chat({"type": "input_text", "text": "hi"}, model="omni"), f"{P0}.type"),
    ("sglang", chat({"type": "refusal", "refusal": "no"}, model="omni"), f"{P0}.type"),
    ("vllm", chat({"type": "image_embeds", "image_embeds": "AAAA"}, model="omni"), f"{P0}.type"),
    ("sglang", chat({"type": "image_embeds", "image_embeds": "AAAA"}, model="omni"), f"{P0}.type"),
    (
        "vllm+mm-embeds",
        chat(image(), {"type": "image_embeds", "image_embeds": "AAAA"}, model="omni"),
        P0,
    ),
    (
        "vllm",
        chat(
            {"type": "video_url", "video_url": {"url": VIDEO}},
            model="omni",
            mm_processor_kwargs={"use_audio_in_video": True},
        ),
        "mm_processor_kwargs",
    ),
    (
        "vllm",
        chat(TEXT, model="omni", media_io_kwargs={"video": {"num_frames": 4}}),
        "media_io_kwargs",
    ),
    (
        "sglang",
        {"model": "omni", "messages": [{"role": "narrator", "content": "hi"}]},
        "messages.[0].role",
    ),
    ("sglang", {"model": "omni", "messages": [{"role": "user"}]}, "messages.[0].content"),
    # SGLang lower-cases the roles it takes, but its user message is a Literal["user"].
    (
        "sglang",
        {"model": "omni", "messages": [{"role": "User", "content": "hi"}]},
        "messages.[0].role",
    ),
    ("sglang", {"model": "omni", "messages": [{"role": "USER"}]}, "messages.[0].role"),
    (
        "vllm",
        {"model": "omni", "messages": [{"role": "system", "content": None}]},
        "messages.[0].content",
    ),
    ("openai", chat("hello", model="omni"), P0),
    ("sglang", chat({"type": "thinking", "thinking": "hmm"}, model="omni"), f"{P0}.type"),
    # vLLM reads a message with only parts its own union does not know as OpenAI's:
    ("vllm", chat({"type": "input_text", "text": "hi"}, model="omni"), P0),
    ("vllm", chat({"image_url": {"url": PNG}}, model="omni"), P0),
    ("vllm", chat("hello", model="omni"), P0),
    ("vllm", chat(audio("flac"), model="omni"), P0),
    ("vllm", chat({"type": "input_image", "image_url": PNG}, model="omni"), P0),
    ("vllm", chat({"type": "prompt_embeds", "data": "AAAA"}, model="omni"), f"{P0}.type"),
    ("vllm+prompt-embeds", chat({"type": "prompt_embeds", "data": ""}, model="omni"), f"{P0}.data"),
]


@pytest.mark.parametrize(("engine", "request_body", "param"), REFUSED)
def test_a_shape_the_engine_refuses_gets_the_gates_own_400(engine, request_body, param, matcher):
    verdict = judged(request_body, matcher, DIALECTS[engine])
    assert not verdict.accepted
    first = verdict.violations[0]
    assert (first.code, first.param, verdict.status) == (ErrorCode.INVALID_REQUEST, param, 400)
    assert first.message.startswith(f"{param}: ")


ACCEPTED = [
    ("sglang", chat(image(detail="default"), model="omni")),
    ("vllm", chat(image(detail="original"), model="omni")),
    ("openai", chat(image(detail="original"), model="omni")),
    ("vllm", chat({"image_url": PNG}, model="omni")),
    ("vllm", chat({"video_url": VIDEO}, model="omni")),
    ("vllm", chat(TEXT, {"image_url": {"url": PNG}}, model="omni")),
    ("vllm", chat({"type": "input_text", "text": "hi"}, image(), model="omni")),
    ("vllm", chat("hello", TEXT, model="omni")),
    ("vllm", chat(TEXT, audio("flac"), model="omni")),
    ("vllm+mm-embeds", chat({"type": "image_embeds", "image_embeds": "AAAA"}, model="omni")),
    ("vllm", {"model": "omni", "messages": []}),
    ("vllm", {"model": "omni", "messages": [{"role": "user"}]}),
    ("vllm", {"model": "omni", "messages": [{"role": "narrator", "content": [TEXT]}]}),
    ("sglang", {"model": "omni", "messages": [{"role": "assistant", "content": None}]}),
    (
        "sglang",
        {"model": "omni", "messages": [{"role": "System"}, {"role": "user", "content": "x"}]},
    ),
    ("sglang", chat(TEXT, model="omni", mm_processor_kwargs={"use_audio_in_video": True})),
    # SGLang's models drop keys they do not declare: a text part's stray key is not read.
    ("sglang", chat({**TEXT, "video_embeds": "AAAA"}, model="omni")),
    ("vllm", chat({**TEXT, "video_embeds": "AAAA"}, model="omni")),
]


@pytest.mark.parametrize(("engine", "request_body"), ACCEPTED)
def test_a_shape_the_engine_takes_passes(engine, request_body, matcher):
    verdict = judged(request_body, matcher, DIALECTS[engine])
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]


def test_with_a_uuid_vllm_reads_the_payload_key_and_sglang_the_type(matcher):
    part = {**TEXT, "uuid": "u-1", "video_url": {"url": VIDEO}}
    as_vllm = judged(chat(part, model="omni"), matcher, VLLM)
    assert [(p.part_type, p.modality) for p in as_vllm.parts] == [("video_url", "video")]
    assert judged(chat(part, model="omni"), matcher, SGLANG).parts == ()
    refused = judged(chat(part, model="omni"), matcher, OPENAI)  # make them agree
    assert (refused.violations[0].code, refused.violations[0].param) == (
        ErrorCode.INVALID_REQUEST,
        f"{P0}.type",
    )


def test_vllm_takes_a_uuid_with_no_payload_as_cached_media(matcher):
    verdict = judged(chat({"image_pil": None, "uuid": "u-9"}, model="omni"), matcher, VLLM)
    assert [(p.modality, p.source) for p in verdict.parts] == [("image", "cached")]
    refused = judged(chat({"image_pil": "x"}, model="omni"), matcher, VLLM)
    assert refused.violations[0].code is ErrorCode.UNSUPPORTED_CONTENT_TYPE


def test_use_audio_in_video_counts_where_the_engine_reads_it(matcher):
    video = {"type": "video_url", "video_url": {"url": VIDEO}}
    top_level = chat(video, model="qwen2.5-vl", use_audio_in_video=True)
    refused = judged(top_level, matcher, SGLANG)
    assert (refused.violations[0].code, refused.violations[0].param) == (
        ErrorCode.UNSUPPORTED_MODALITY,
        "use_audio_in_video",
    )
    assert judged(top_level, matcher, VLLM_TRUSTING).accepted  # vLLM ignores the top level
    kwargs = chat(video, model="qwen2.5-vl", mm_processor_kwargs={"use_audio_in_video": True})
    refused = judged(kwargs, matcher, VLLM_TRUSTING)
    assert refused.violations[0].param == "mm_processor_kwargs.use_audio_in_video"


def test_a_rules_own_engine_wins_over_the_dialect_given(matcher):
    string_url = chat({"image_url": PNG}, model="on-sglang")
    verdict = judged(string_url, matcher, VLLM)
    assert (verdict.violations[0].code, verdict.violations[0].param) == (
        ErrorCode.INVALID_REQUEST,
        f"{P0}.type",
    )
    embeds = chat({"type": "image_embeds", "image_embeds": "AAAA"}, model="on-vllm-embeds")
    assert judged(embeds, matcher, None).accepted
    assert judged(embeds, matcher, SGLANG).accepted  # the rule says vllm with embeds


def test_without_a_dialect_the_server_is_taken_for_an_openai_compatible_one(matcher):
    assert judged(chat({"image_url": PNG}, model="omni"), matcher, None).violations[0].param == (
        f"{P0}.type"
    )
    assert judged(chat(image(detail="original"), model="omni"), matcher, None).accepted


def test_the_responses_api_is_read_in_the_openai_dialect(matcher):
    request = {
        "model": "omni",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "hi"},
                    {"type": "input_image", "image_url": PNG},
                ],
            }
        ],
    }
    verdict = validate_body(body(request), matcher, "responses", dialect=lambda _: SGLANG)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]


def test_engine_shorthand_and_flags_in_a_policy():
    policy = parse_policy(POLICY, fmt="yaml")
    rules = {rule.name: rule.engine for rule in policy.models[:3]}
    assert rules == {
        "omni": None,
        "on-sglang": EngineSpec(name="sglang"),
        "on-vllm-embeds": EngineSpec(name="vllm", enable_mm_embeds=True),
    }


def test_policy_doc_dialect_table_is_the_generated_one():
    assert committed() == render(), "run: python tests/conformance/dialect_table.py --write"


def test_the_openai_dialect_names_every_part_type_the_gate_reads() -> None:
    # dialects.py cannot import parts.py (parts reads through it): this keeps the copy honest.
    assert OPENAI.types | {"image_pil"} == set(PART_KINDS)


def test_sglang_judges_a_role_as_the_lower_cased_role_it_reads(matcher):
    """'Assistant' is SGLang's assistant: a thinking part passes there, and the policy's
    roles are applied to the role as read."""
    thinking = {"type": "thinking", "thinking": "hmm"}
    messages = [{"role": "user", "content": "q"}, {"role": "Assistant", "content": [thinking]}]
    assert judged({"model": "omni", "messages": messages}, matcher, SGLANG).accepted
    refused = judged(chat(image(), model="omni", role="User"), matcher, SGLANG)
    first = refused.violations[0]
    assert (first.code, first.param) == (ErrorCode.INVALID_REQUEST, "messages.[0].role")
    assert first.message == "messages.[0].role: sglang takes the role 'user' in lower case only"
