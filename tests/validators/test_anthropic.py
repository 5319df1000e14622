"""The Anthropic Messages API reader: blocks read as vLLM and SGLang convert them, each
fault with its code and param, and no block shape a 500."""

from __future__ import annotations

import orjson
import pytest

from conftest import b64, image_bytes
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import validate_body

PNG = image_bytes("PNG", (64, 48))


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(load_policy(), None)


def _judged(matcher: RuleMatcher, content: object, role: object = "user") -> tuple | None:
    body = {"model": "kimi-k3", "max_tokens": 8, "messages": [{"role": role, "content": content}]}
    verdict = validate_body(orjson.dumps(body), matcher, "anthropic")
    if verdict.accepted:
        return None
    return verdict.violations[0].code.value, verdict.violations[0].param


def _image(source: dict) -> dict:
    return {"type": "image", "source": source}


@pytest.mark.parametrize(
    ("content", "role", "expected"),
    [
        # Shapes no engine takes: refused with their param, never a TypeError.
        ([{"type": ["image"]}], "user", ("invalid_request", "messages.[0].content.[0].type")),
        ("hi", ["user"], ("invalid_request", "messages.[0].role")),
        (
            [_image({"type": ["url"]})],
            "user",
            ("invalid_request", "messages.[0].content.[0].source.type"),
        ),
        # A PDF for an image-only model: a file.
        (
            [
                {
                    "type": "document",
                    "source": {
                        "type": "base64",
                        "media_type": "application/pdf",
                        "data": b64(b"%PDF-1.7"),
                    },
                }
            ],
            "user",
            ("unsupported_modality", "messages.[0].content.[0].type"),
        ),
        # A URL source is fetched by the engine: held to the media URL rules first.
        (
            [_image({"type": "url", "url": "http://127.0.0.1/a.png"})],
            "user",
            ("url_not_allowed", "messages.[0].content.[0].source.url"),
        ),
        # Media in an assistant's turn (the engines make it an assistant content part).
        (
            [_image({"type": "base64", "media_type": "image/png", "data": b64(PNG)})],
            "assistant",
            ("role_not_allowed", "messages.[0].content.[0]"),
        ),
    ],
)
def test_each_fault_has_its_code_and_param(matcher, content, role, expected):
    assert _judged(matcher, content, role) == expected


def test_images_in_a_users_tool_result_are_judged_and_text_documents_are_text(matcher):
    cut = {"type": "base64", "media_type": "image/png", "data": b64(PNG[:40])}
    tool_result = {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [{"type": {"x": 1}}, _image(cut)],
    }
    assert _judged(matcher, [tool_result]) == (
        "invalid_image",
        "messages.[0].content.[0].content.[1].source.data",
    )
    text_document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "x"},
    }
    assert _judged(matcher, [text_document]) is None
    # An assistant's tool result is flattened to text by the engines: nothing to judge.
    assert _judged(matcher, [{**tool_result, "content": [_image(cut)]}], "assistant") is None
