"""A stand-in model server for the compose example: OpenAI-compatible, answers at once.

It lists one model, answers every chat completion with one assistant message
(streamed as SSE chunks when asked) and says what it received, so a request
that reached it shows it passed the gate. Replace it by vLLM, SGLang or any
OpenAI-compatible server; the gateway does not know the difference.

    python deploy/stub_upstream.py --host 0.0.0.0 --port 8001 --model stub
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def create_app(model: str) -> Starlette:
    async def models(request: Request) -> Response:
        listed = {"id": model, "object": "model", "created": 0, "owned_by": "stub"}
        return JSONResponse({"object": "list", "data": [listed]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def chat(request: Request) -> Response:
        body = await request.body()
        payload = json.loads(body)
        text = f"stub upstream: {len(body)} bytes received"
        if payload.get("stream"):
            return StreamingResponse(
                _chunks(payload.get("model", model), text), media_type="text/event-stream"
            )
        return JSONResponse(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": payload.get("model", model),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


def _chunks(model: str, text: str) -> Iterator[bytes]:
    for index, delta in enumerate(({"role": "assistant", "content": ""}, {"content": text})):
        chunk = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if index else None}],
        }
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default="stub", help="the one model it lists")
    args = parser.parse_args()
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
