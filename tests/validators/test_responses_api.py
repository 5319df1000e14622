"""The Responses API (``POST /v1/responses``) gets the same gate as Chat Completions.

Its ``input`` is a string or a list of items; messages and tool outputs carry
content parts (``input_text``, ``input_image``, ``input_file``, and the vLLM
extensions), other items (reasoning, function calls) pass. Unit cases on
``validate_body(..., api="responses")``, then the official openai client's
``responses.create`` through a real ``modalgate serve`` process.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from conftest import MP4_BYTES, PDF_BYTES, data_url, image_bytes, serve
from gateway_proc import GatewayProcess
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import validate_body
from toy_upstream import ToyUpstream

IMAGE = data_url(image_bytes())
VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
JSON = {"content-type": "application/json"}
PDF = {
    "type": "input_file",
    "filename": "a.pdf",
    "file_data": data_url(PDF_BYTES, "application/pdf"),
}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def image(url: str = IMAGE) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url}


def verdict(input_: Any, model: str = "kimi-k3", mode: str | None = "encoder", **extra: Any):
    request = {"model": model, **({"input": input_} if input_ is not None else {}), **extra}
    return validate_body(orjson.dumps(request), RuleMatcher(load_policy(), mode), api="responses")


def refusal(input_: Any, **kwargs: Any) -> tuple[str, str | None, str]:
    result = verdict(input_, **kwargs)
    assert not result.accepted
    first = result.violations[0]
    return first.code.value, first.param, first.message


@pytest.mark.parametrize(
    ("input_", "images"),
    [
        ("describe a cat", 0),
        ([user({"type": "input_text", "text": "what is this?"}, image())], 1),
        ([{"type": "message", "role": "user", "content": "plain text"}], 0),
        (
            [
                user(image()),
                {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
            ],
            1,
        ),
        (
            [
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                user(image()),
            ],
            1,
        ),
        ([user(image(), image())], 2),
        # vLLM turns a tool output's input_image into an image of a tool message.
        ([{"type": "function_call_output", "call_id": "c", "output": [image()]}], 1),
    ],
    ids=[
        "string",
        "text-and-image",
        "message-item",
        "assistant-turn",
        "tool-items",
        "two-images",
        "image-in-tool-output",
    ],
)
def test_clean_inputs_are_accepted(input_, images):
    result = verdict(input_)
    assert result.accepted, result.violations
    assert result.api == "responses"
    assert [p.modality for p in result.parts] == ["image"] * images


@pytest.mark.parametrize(
    ("input_", "expected"),
    [
        (
            [user(PDF)],
            (
                "unsupported_modality",
                "input.[0].content.[0].type",
                "input.[0].content.[0].type: Kimi-K3 encoder mode supports image input only"
                " (got file input)",
            ),
        ),
        (
            [user({"type": "input_text", "text": "x"}), user(VIDEO)],
            (
                "unsupported_modality",
                "input.[1].content.[0].type",
                "input.[1].content.[0].type: Kimi-K3 encoder mode supports image input only"
                " (got video input)",
            ),
        ),
        (None, ("invalid_request", "input", "input: 'input' is required")),
        (7, ("invalid_request", "input", "input: 'input' must be a string or an array of items")),
        (["hi"], ("invalid_request", "input.[0]", "input.[0]: each input item must be an object")),
        (
            [{"content": "no role"}],
            ("invalid_request", "input.[0].role", "input.[0].role: 'role' must be a string"),
        ),
        (
            [user({"type": "input_image"})],
            (
                "invalid_request",
                "input.[0].content.[0].image_url",
                "input.[0].content.[0].image_url: must carry a string 'image_url' or 'file_id'",
            ),
        ),
        (
            [user({"type": "hologram", "data": "x"})],
            (
                "unsupported_content_type",
                "input.[0].content.[0].type",
                "input.[0].content.[0].type: unknown content part type 'hologram'",
            ),
        ),
    ],
    ids=[
        "file",
        "video",
        "missing",
        "not-a-list",
        "item-not-object",
        "message-without-role",
        "image-without-url",
        "unknown-part",
    ],
)
def test_refusals_name_the_input_item(input_, expected):
    assert refusal(input_) == expected


def test_image_limits_apply_as_in_chat():
    code, param, _ = refusal([user(*[image()] * 17)])
    assert (code, param) == ("too_many_media", "input.[0].content.[16]")
    code, param, _ = refusal([user(image("data:image/png;base64,aGVsbG8="))])
    assert (code, param) == ("invalid_image", "input.[0].content.[0].image_url")


def test_a_chat_path_still_wants_messages():
    body = orjson.dumps({"model": "kimi-k3", "input": "hi"})
    result = validate_body(body, RuleMatcher(load_policy(), "encoder"))
    assert [(v.code.value, v.param) for v in result.violations] == [("invalid_request", "messages")]


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[ToyUpstream, GatewayProcess]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base, GatewayProcess("--upstream", base, "--mode", "encoder") as gw:
        yield toy, gw


def test_openai_client_responses_reach_the_upstream_unchanged(gateway):
    toy, gw = gateway
    toy.received.clear()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    response = client.responses.create(
        model="kimi-k3",
        input=[user({"type": "input_text", "text": "what is this?"}, image())],
    )
    (received,) = toy.received
    assert received.path == "/v1/responses"
    assert response.output_text == f"toy saw {len(received.body)} bytes"
    assert received.json()["input"][0]["content"][1] == image()


def test_openai_client_responses_refusal_is_a_400_with_code_and_param(gateway):
    toy, gw = gateway
    toy.received.clear()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="kimi-k3", input=[user(PDF)])
    assert caught.value.status_code == 400
    assert caught.value.code == "unsupported_modality"
    assert caught.value.param == "input.[0].content.[0].type"
    assert toy.received == []


def test_other_responses_paths_are_proxied_as_they_are(gateway):
    toy, gw = gateway
    toy.received.clear()
    # GET /v1/responses/{id} is not a request to the model: not gated.
    response = httpx.get(gw.url + "/v1/responses/resp_1")
    # The toy has no such route: Starlette's own plain 404 came back, not a gateway error.
    assert (response.status_code, response.text) == (404, "Not Found")


def test_validate_endpoint_and_command_take_responses_bodies(gateway, tmp_path):
    _, gw = gateway
    body = orjson.dumps({"model": "kimi-k3", "input": [user(PDF)]})
    answer = httpx.post(gw.url + "/v1/validate/responses", content=body, headers=JSON)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "input.[0].content.[0].type"
    clean = orjson.dumps({"model": "kimi-k3", "input": [user(image())]})
    answer = httpx.post(gw.url + "/v1/validate/responses", content=clean, headers=JSON)
    assert answer.status_code == 200 and answer.json()["accepted"] is True

    request = tmp_path / "request.json"
    request.write_bytes(body)
    command = [sys.executable, "-m", "modalgate.gateway.cli", "validate", str(request)]
    done = subprocess.run(
        [*command, "--api", "responses", "--mode", "encoder"], capture_output=True
    )
    assert done.returncode == 1
    assert orjson.loads(done.stdout)["error"]["code"] == "unsupported_modality"
    done = subprocess.run(command, capture_output=True)  # read as chat: no messages
    assert done.returncode == 1
    assert orjson.loads(done.stdout)["error"]["param"] == "messages"


# Items are read by their type first, as the servers read them: a tool output's
# ``output`` is its tool message's content whatever ``role`` the item also carries.
@pytest.mark.parametrize(
    ("item", "model", "mode", "expected"),
    [
        (
            {
                "type": "function_call_output",
                "role": "user",
                "call_id": "c",
                "output": [image("http://169.254.169.254/latest/meta-data/a.png")],
            },
            "kimi-k3",
            "encoder",
            ("url_not_allowed", "input.[0].output.[0].image_url"),
        ),
        (
            {"type": "function_call_output", "role": "user", "call_id": "c", "output": [image()]},
            "google/gemma-3-1b-it",
            None,
            ("unsupported_modality", "input.[0].output.[0].type"),
        ),
        (
            {"type": "custom_tool_call_output", "role": "tool", "call_id": "c", "output": [PDF]},
            "kimi-k3",
            "encoder",
            ("unsupported_modality", "input.[0].output.[0].type"),
        ),
        (
            {**image(), "role": "user"},
            "google/gemma-3-1b-it",
            None,
            ("unsupported_modality", "input.[0].type"),
        ),
        (
            {
                "type": "function_call_output",
                "role": "user",
                "call_id": "c",
                "output": "42",
                "content": [image()],
            },
            "google/gemma-3-1b-it",
            None,
            ("unsupported_modality", "input.[0].content.[0].type"),
        ),
        (
            {
                "type": "function_call",
                "role": "assistant",
                "call_id": "c",
                "name": "f",
                "arguments": "{}",
                "content": [image()],
            },
            "google/gemma-3-1b-it",
            None,
            ("unsupported_modality", "input.[0].content.[0].type"),
        ),
    ],
    ids=[
        "metadata-ip-in-output",
        "image-in-output-text-only",
        "file-in-custom-output",
        "part-with-role",
        "content-beside-output",
        "content-of-a-call-with-role",
    ],
)
def test_typed_items_with_a_role_are_read_by_their_type(item, model, mode, expected):
    code, param, _ = refusal([item], model=model, mode=mode)
    assert (code, param) == expected


def test_a_tool_output_with_a_role_and_a_clean_image_is_kept():
    item = {"type": "function_call_output", "role": "user", "call_id": "c", "output": [image()]}
    result = verdict([item])
    assert result.accepted, result.violations
    assert [p.param for p in result.parts] == ["input.[0].output.[0]"]
