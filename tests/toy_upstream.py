"""A small real OpenAI-compatible server for the proxy tests: Starlette, SSE with delays.

It records what it receives and when it sends each token, so tests can check
what crossed the gateway and when. Runs in the test process (``serve()``) or
as its own process: ``python tests/toy_upstream.py --port P --name NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# Paths where vLLM and SGLang take messages or media besides chat, and an admin one.
OTHER_DOORS = (
    "/v1/completions",
    "/v1/embeddings",
    "/tokenize",
    "/generate",
    "/flush_cache",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/batch",
    "/v1/rerank",
    "/score",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/invocations",
    "/inference/v1/generate",
    "/v1/audio/transcriptions",
)


@dataclass
class Received:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes
    raw_path: bytes = b""

    def json(self) -> Any:
        # Python's json, as the engines read bodies: it takes 1e400 and 2**70 as they are.
        return json.loads(self.body)


@dataclass
class Behaviour:
    tokens: int = 5
    token_delay_s: float = 0.0
    headers_delay_s: float = 0.0  # before the response starts
    reset_after: int | None = None  # die after this many tokens
    status: int = 200


@dataclass
class ToyUpstream:
    name: str = "toy"
    owned_by: str = "toy"  # what /v1/models says of the models: vLLM says "vllm"
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[Received] = field(default_factory=list)
    token_sent_at: list[float] = field(default_factory=list)
    streams_cancelled: int = 0
    streams_finished: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/echo/{rest:path}", self._echo, methods=["GET", "POST", "PUT", "DELETE"]),
                # The engines' other doors: recorded and answered, whatever the body.
                Route("/v1/messages", self._anthropic, methods=["POST"]),
                *(Route(door, self._other_door, methods=["POST", "PUT"]) for door in OTHER_DOORS),
                # For tests driving this server as its own process: what it received.
                Route("/_received", self._received, methods=["GET", "DELETE"]),
            ]
        )

    async def _record(self, request: Request) -> Received:
        body = await request.body()
        received = Received(
            request.method,
            request.url.path,
            request.url.query,
            dict(request.headers),
            [(k.decode(), v.decode()) for k, v in request.scope["headers"]],
            body,
            request.scope.get("raw_path", b""),
        )
        with self.lock:
            self.received.append(received)
        return received

    async def _chat(self, request: Request) -> Response:
        received = await self._record(request)
        behaviour = self.behaviour
        if behaviour.headers_delay_s:
            await asyncio.sleep(behaviour.headers_delay_s)
        payload = received.json()
        model = payload.get("model", "")
        if behaviour.status != 200:
            return JSONResponse(
                {
                    "object": "error",
                    "message": "upstream says no",
                    "type": "BadRequestError",
                    "param": None,
                    "code": behaviour.status,
                },
                status_code=behaviour.status,
                headers={"x-upstream-own": "kept"},
            )
        if payload.get("stream"):
            return StreamingResponse(
                self._tokens(model),
                media_type="text/event-stream",
                headers={"x-upstream-own": "kept"},
            )
        return JSONResponse(
            _completion(model, f"{self.name} saw {len(received.body)} bytes"),
            headers={"x-upstream-own": "kept"},
        )

    async def _other_door(self, request: Request) -> Response:
        received = await self._record(request)
        return JSONResponse({"object": "toy.other", "path": received.path})

    async def _anthropic(self, request: Request) -> Response:
        """An Anthropic Messages API answer, as vLLM's and SGLang's /v1/messages give one."""
        received = await self._record(request)
        return JSONResponse(
            {
                "id": "msg_toy",
                "type": "message",
                "role": "assistant",
                "model": received.json().get("model", ""),
                "content": [{"type": "text", "text": f"{self.name} saw {len(received.body)}"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1},
            }
        )

    async def _responses(self, request: Request) -> Response:
        received = await self._record(request)
        model = received.json().get("model", "")
        return JSONResponse(_response_object(model, f"{self.name} saw {len(received.body)} bytes"))

    async def _tokens(self, model: str):
        behaviour = self.behaviour
        sent = 0
        try:
            for index in range(behaviour.tokens):
                if behaviour.reset_after is not None and index == behaviour.reset_after:
                    raise ConnectionResetError("the toy upstream dies mid-stream")
                if index and behaviour.token_delay_s:
                    await asyncio.sleep(behaviour.token_delay_s)
                chunk = _chunk(model, f"t{index} ")
                self.token_sent_at.append(time.monotonic())
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                sent += 1
            yield b"data: [DONE]\n\n"
            self.streams_finished += 1
        finally:
            if sent < behaviour.tokens and behaviour.reset_after is None:
                self.streams_cancelled += 1

    async def _received(self, request: Request) -> Response:
        with self.lock:
            if request.method == "DELETE":
                self.received.clear()
                return Response(status_code=204)
            return JSONResponse(
                [
                    {
                        "method": r.method,
                        "path": r.path,
                        "headers": r.headers,
                        "body": r.body.decode("utf-8", "replace"),
                    }
                    for r in self.received
                ]
            )

    async def _models(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.name, "object": "model", "owned_by": self.owned_by}],
            }
        )

    async def _health(self, request: Request) -> Response:
        return Response(b"", 200)

    async def _echo(self, request: Request) -> Response:
        received = await self._record(request)
        response = JSONResponse(
            {
                "method": received.method,
                "path": received.path,
                "query": received.query,
                "bytes": len(received.body),
            },
            status_code=201 if request.method == "PUT" else 200,
        )
        if "setcookie" in received.query:
            response.set_cookie("upstream_session", "secret-of-one-user")
        return response


def _response_object(model: str, text: str) -> dict[str, Any]:
    """A minimal Responses API object: one assistant message."""
    return {
        "id": "resp_toy",
        "object": "response",
        "created_at": 1764633600,
        "model": model,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_toy",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }


def _completion(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-toy",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _chunk(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-toy",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="toy")
    args = parser.parse_args()
    uvicorn.run(ToyUpstream(args.name).app(), host="127.0.0.1", port=args.port, log_level="warning")
