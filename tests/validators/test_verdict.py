"""A verdict is not changed after it is made: every stage that learns more returns a new one.

The request's state, logs and metrics may hold a verdict while a later stage works;
what they hold must stay what it was when they took it.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields, replace
from typing import Any

import pytest

from conftest import body, chat, data_url, image_bytes, image_part
from modalgate.errors import ErrorCode, Violation
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.validators import (
    MediaPart,
    Verdict,
    check_fetched,
    validate_body,
    with_fallback,
)
from modalgate.validators.verdict import PartDraft

PNG = image_bytes("PNG", (40, 30))
POLICY = parse_policy(
    """
media_urls:
  schemes: [data, https]
models:
  - {name: vision, accepts: [image], fallback: {video: omni}}
  - {name: omni, accepts: [image, video]}
""",
    fmt="yaml",
)
MATCHER = RuleMatcher(POLICY, None)
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}


def judged(*parts: Any) -> Verdict:
    return validate_body(body(chat(*parts, model="vision")), MATCHER)


def mutations(verdict: Verdict) -> list[tuple[str, Any]]:
    """Every way a holder of the verdict could change it in place."""
    attempts: list[tuple[str, Any]] = [
        ("set model", lambda: setattr(verdict, "model", "other")),
        ("set rule", lambda: setattr(verdict, "rule", None)),
        ("set parts", lambda: setattr(verdict, "parts", [])),
        ("set violations", lambda: setattr(verdict, "violations", [])),
        ("set routed_from", lambda: setattr(verdict, "routed_from", "x")),
        ("delete api", lambda: delattr(verdict, "api")),
        ("add a violation", lambda: verdict.violations.append(None)),  # type: ignore[attr-defined]
        ("add a part", lambda: verdict.parts.append(None)),  # type: ignore[attr-defined]
        ("replace a part", lambda: verdict.parts.__setitem__(0, None)),  # type: ignore[attr-defined]
        ("add a modality", lambda: verdict.unsupported.add("audio")),  # type: ignore[attr-defined]
    ]
    for part in verdict.parts:
        attempts += [
            ("set a part's data", lambda part=part: setattr(part, "data", b"")),
            ("set a part's width", lambda part=part: setattr(part, "width", 1)),
            ("set a part's url", lambda part=part: setattr(part, "url", "https://evil")),
        ]
    return attempts


def assert_frozen(verdict: Verdict) -> None:
    for name, attempt in mutations(verdict):
        with pytest.raises((FrozenInstanceError, AttributeError, TypeError)):
            attempt()
            pytest.fail(f"{name}: changed the verdict")


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param((), id="text-only"),
        pytest.param((image_part(data_url(PNG)),), id="accepted-image"),
        pytest.param((image_part("https://example.com/a.png"),), id="remote-image"),
        pytest.param((VIDEO,), id="refused-video"),
        pytest.param((image_part("data:image/png;base64,!!!"),), id="refused-base64"),
    ],
)
def test_a_verdict_from_validate_body_cannot_be_changed(parts):
    verdict = judged(*parts)
    assert type(verdict) is Verdict
    assert all(type(part) is MediaPart for part in verdict.parts)
    assert isinstance(verdict.violations, tuple) and isinstance(verdict.parts, tuple)
    assert isinstance(verdict.unsupported, frozenset)
    before = repr(verdict)
    assert_frozen(verdict)
    assert repr(verdict) == before


def test_every_field_of_a_built_verdict_is_set():
    """The builder fills a verdict field by field: a field it forgot would be unreadable."""
    for verdict in (judged(), judged(image_part(data_url(PNG))), judged(VIDEO)):
        for field in fields(Verdict):
            getattr(verdict, field.name)
        assert replace(verdict) == verdict
    part = judged(image_part(data_url(PNG))).parts[0]
    assert replace(part) == part
    assert (part.format, part.width, part.height, part.bytes) == ("png", 40, 30, len(PNG))


def test_a_draft_has_the_fields_of_a_media_part_in_order():
    def shape(cls: type) -> list[tuple[str, Any]]:
        return [(field.name, field.default) for field in fields(cls)]

    assert shape(PartDraft) == shape(MediaPart)
    part = judged(image_part(data_url(PNG))).parts[0]
    draft = part.draft()
    draft.width = 7
    assert draft.frozen() == replace(part, width=7) and part.width == 40


def test_refused_media_name_their_modalities_in_a_frozenset():
    verdict = judged(VIDEO, image_part(data_url(PNG)))
    assert verdict.unsupported == frozenset({"video"})
    assert [(v.code, v.param) for v in verdict.violations] == [
        (ErrorCode.UNSUPPORTED_MODALITY, "messages.[0].content.[0].type")
    ]


def test_check_fetched_returns_a_new_verdict_and_leaves_the_given_one_as_it_was():
    verdict = judged(image_part("https://example.com/a.png"))
    remote = verdict.parts[0]
    fetched = check_fetched(verdict, {0: (PNG, "image/png")})

    assert fetched is not verdict and fetched.parts[0] is not remote
    assert verdict.parts[0] is remote and remote.data is None and remote.width is None
    assert (fetched.parts[0].data, fetched.parts[0].width, fetched.parts[0].mime) == (
        PNG,
        40,
        "image/png",
    )
    assert fetched.accepted and verdict.accepted
    assert_frozen(fetched)


def test_check_fetched_refuses_bad_bytes_in_the_new_verdict_only():
    verdict = judged(image_part("https://example.com/a.png"))
    fetched = check_fetched(verdict, {0: (b"not an image", "image/png")})
    assert [(v.code, v.param) for v in fetched.violations] == [
        (ErrorCode.INVALID_IMAGE, "messages.[0].content.[0].image_url.url")
    ]
    assert verdict.violations == () and verdict.accepted


def test_the_fallback_returns_a_new_verdict():
    verdict = judged(VIDEO)
    routed = with_fallback(verdict, MATCHER)
    assert routed is not verdict
    assert (routed.model, routed.routed_from, routed.accepted) == ("omni", "vision", True)
    assert (verdict.model, verdict.routed_from, verdict.accepted) == ("vision", None, False)
    assert_frozen(routed)


def test_a_later_stage_adds_violations_to_a_new_verdict():
    verdict = judged(image_part(data_url(PNG)))
    late = Violation(ErrorCode.PAYLOAD_TOO_LARGE, "too large")
    refused = verdict.with_violations(late)
    assert refused.violations == (late,) and not refused.accepted
    assert verdict.violations == () and verdict.accepted
    assert refused.parts is verdict.parts
