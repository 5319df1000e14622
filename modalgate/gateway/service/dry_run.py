"""A validation service's answer on the chat and Responses paths: a real completion.

Without an upstream nothing generates text, but client code written for a model
server should run unchanged against the gate (a dry run of a rollout). So an
accepted request gets what the OpenAI SDK parses: a ``chat.completion`` (or a
stream of chunks, or a ``response`` object) whose one assistant message is the
verdict in a sentence, with zero usage, and the whole verdict under
``modalgate_verdict``. Refusals never get here: the gate answers them with the
error envelope, as it would in front of a model.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any
from uuid import uuid4

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from modalgate.gateway.gate.middleware import get_verdict, parsed_request
from modalgate.gateway.gate.send import json_bytes
from modalgate.validators import Verdict

VERDICT_KEY = "modalgate_verdict"


async def dry_run_endpoint(request: Request) -> Response:
    verdict = get_verdict(request.scope)
    if verdict is None:  # only reachable if the app is served without its gate
        return Response(status_code=500)
    streamed = bool((await parsed_request(verdict) or {}).get("stream"))
    if verdict.api == "responses":
        response = response_object(verdict)
        if streamed:
            return _sse(_response_events(response))
        return Response(json_bytes(response), media_type="application/json")
    if streamed:
        return _sse(_chunks(verdict))
    return Response(json_bytes(chat_completion(verdict)), media_type="application/json")


def summary(verdict: Verdict) -> str:
    """The verdict in one sentence, for the assistant message."""
    judged = verdict.judged_as or verdict.model
    rule = verdict.rule.name if verdict.rule is not None and verdict.rule.known else None
    where = f"rule {rule!r}" if rule else "no rule (unknown model)"
    mode = f", mode {verdict.mode!r}" if verdict.mode else ""
    routed = f", routed from {verdict.routed_from!r}" if verdict.routed_from else ""
    media = ", ".join(_part_text(part.facts()) for part in verdict.parts) or "no media"
    return f"modalgate accepted this request for {judged!r} ({where}{mode}{routed}): {media}."


def _part_text(facts: dict[str, Any]) -> str:
    shape = f" {facts['width']}x{facts['height']}" if facts.get("width") else ""
    kind = facts.get("format") or facts.get("source")
    return f"{facts['modality']} ({kind}{shape})"


def chat_completion(verdict: Verdict) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-modalgate-{uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": verdict.model or "",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": summary(verdict)},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        VERDICT_KEY: verdict.to_dict(),
    }


async def _chunks(verdict: Verdict) -> AsyncIterator[bytes]:
    """The completion as one content chunk, a finishing chunk and ``[DONE]``; usage too when
    ``stream_options.include_usage`` asks for it, as OpenAI sends it."""
    head = {
        "id": f"chatcmpl-modalgate-{uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": verdict.model or "",
    }
    delta = {"role": "assistant", "content": summary(verdict)}
    first = {**head, "choices": [_choice(delta, None)], VERDICT_KEY: verdict.to_dict()}
    yield _event(first)
    yield _event({**head, "choices": [_choice({}, "stop")]})
    options = (verdict.request or {}).get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        yield _event({**head, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def _choice(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def response_object(verdict: Verdict) -> dict[str, Any]:
    """A completed Responses API object with one assistant message."""
    return {
        "id": f"resp_modalgate_{uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": verdict.model or "",
        "status": "completed",
        "output": [_message(summary(verdict))],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        },
        VERDICT_KEY: verdict.to_dict(),
    }


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_modalgate_{uuid4().hex}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


async def _response_events(response: dict[str, Any]) -> AsyncIterator[bytes]:
    """The Responses stream's events for one message of one text part, in OpenAI's order."""
    message = response["output"][0]
    part = message["content"][0]
    pending = {**response, "status": "in_progress", "output": []}
    at = {"output_index": 0, "item_id": message["id"], "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**message, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", **at, "delta": part["text"], "logprobs": []},
        {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": message},
        {"type": "response.completed", "response": response},
    ]
    for number, event in enumerate(events):
        yield (
            b"event: "
            + event["type"].encode()
            + b"\n"
            + _event({**event, "sequence_number": number})
        )


def _event(value: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(value) + b"\n\n"


def _sse(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream")
