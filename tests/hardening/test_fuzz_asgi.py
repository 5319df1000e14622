"""Hostile HTTP requests against the whole gateway: the long-run fuzzer at a CI budget.

``tests/corpora/fuzz_long.py`` runs a million of these; here a few thousand go
through the gateway in process (as ASGI calls, the real ``create_app`` stack
with its upstream pool replaced by a recording one), through ``ModalGate``
alone in full mode, and a few hundred through a real ``modalgate serve``
subprocess. Every answer must hold the invariants (no exception, one response,
no unexplained 5xx, the error envelope on every non-2xx, no media a rule
refuses reaching the upstream). One test turns the fuzzer on a deliberately
broken gate, so a harness that silently stopped checking would fail too.

``MODALGATE_FUZZ_ASGI_REQUESTS`` sets the in-process budget (default 3000);
``MODALGATE_FUZZ_SEED`` the seed (fixed by default, so a failure reproduces:
``python tests/corpora/fuzz_long.py --seed S --requests N`` replays the run, and
``python tests/corpora/hostile.py show S INDEX`` prints one request).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from corpora import fuzz_long  # the long-run harness, shared
from corpora.hostile import ID_HEADER, UPSTREAM_MARK

REQUESTS = int(os.environ.get("MODALGATE_FUZZ_ASGI_REQUESTS", "3000"))
SEED = int(os.environ.get("MODALGATE_FUZZ_SEED", "20250601"))
DEADLINE_S = 1e12  # the budget is the request count; the per-request timeout still holds


def _failures(tally: fuzz_long.Tally) -> str:
    """Each failing class with its first input, readable enough to act on from CI's log."""
    lines = []
    for kind in fuzz_long.FAILING:
        if not tally.by_class[kind]:
            continue
        sample = tally.samples[kind][0]
        request = sample["request"]
        lines.append(
            f"{kind}: {tally.by_class[kind]} of {tally.total}; first: request {request['index']} "
            f"{request['method']} {request['target']} headers={request['headers']}\n"
            f"  body: {request.get('body_text', '(not UTF-8) ' + request['body_b64'])[:600]}\n"
            f"  status {sample['status']}: {sample['detail'][:800]}"
        )
    return "\n".join(lines)


def _run(
    requests: int,
    mode: str | None,
    app_kind: str,
    seed: int = SEED,
    wrap: Any = None,
    served: str | None = fuzz_long.DEFAULT_SERVED,
) -> fuzz_long.Tally:
    import asyncio

    return asyncio.run(
        fuzz_long.run_asgi(
            seed, 0, requests, 1, mode, app_kind, 10.0, _deadline(), 8, None, wrap, served
        )
    )


def _deadline() -> float:
    import time

    return time.monotonic() + DEADLINE_S


def test_gateway_in_process_holds_every_invariant():
    # In front of a Kimi-K3 encoder that lists itself: whatever name a request carries,
    # no video or audio may reach it.
    tally = _run(REQUESTS, "encoder", "gateway")
    assert tally.total == REQUESTS
    # The mix reaches every stage: refusals of many kinds, and requests forwarded.
    assert tally.forwarded > REQUESTS // 20
    assert len([c for c in tally.by_code if not c.startswith("(")]) >= 8, tally.by_code
    if tally.failures:
        pytest.fail(_failures(tally), pytrace=False)


def test_middleware_alone_in_full_mode_holds_every_invariant():
    # No served model: requests are judged by their names, and so is what arrives.
    tally = _run(REQUESTS // 2, None, "middleware", seed=SEED + 1, served=None)
    assert tally.total == REQUESTS // 2
    if tally.failures:
        pytest.fail(_failures(tally), pytrace=False)


def test_through_modalgate_serve_holds_every_invariant():
    tally = fuzz_long.fuzz_serve(
        300, SEED + 2, "encoder", concurrency=16, timeout_s=10.0, max_seconds=None, verbose=False
    )
    assert tally.total == 300
    assert tally.forwarded > 0
    if tally.failures:
        pytest.fail(_failures(tally), pytrace=False)


# ---------------------------------------------------------------- the harness can fail


class _BrokenGate:
    """Everything a gate must not do, each on some of the fuzzer's inputs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if b"__never__" in body or body[:1] == b"[":
            raise ValueError("the broken gate crashed")
        if b"1e400" in body or b"\\ud800" in body:
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"Internal Server Error"})
            return
        if b'"text":""' in body:
            error = {"error": {"message": "at 0xdeadbeefcafe", "type": "x", "code": "nope"}}
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": json.dumps(error).encode()})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)  # forwards video for kimi-k3: a bypass


def test_the_harness_catches_a_broken_gate():
    tally = _run(600, "encoder", "gateway", wrap=_BrokenGate)
    for kind in ("unhandled", "5xx", "envelope", "bypass"):
        assert tally.by_class[kind] > 0, (kind, dict(tally.by_class))
    assert tally.failures


def test_envelope_and_bypass_checks_on_known_answers():
    from corpora.hostile import HostileRequest, envelope_problem, upstream_findings

    good = (
        b'{"error":{"message":"m","type":"invalid_request_error","param":null,'
        b'"code":"invalid_json","violations":[{"code":"invalid_json","message":"m","param":null}]}}'
    )
    assert envelope_problem(good, 400) is None
    assert envelope_problem(b"Method Not Allowed", 405) is not None
    assert envelope_problem(good.replace(b'"m"', b'"<object at 0x7f00deadbeef>"'), 400)
    resolve = lambda model: (model == "kimi-k3", frozenset({"image"}))  # noqa: E731
    video = (
        b'{"model":"kimi-k3","messages":[{"role":"user","content":'
        b'[{"type":"text","text":"x","uuid":"1","video_url":{"url":"https://x.test/v.mp4"}}]}]}'
    )
    kinds = [
        f.kind for f in upstream_findings("POST", b"/v1/chat/completions", video, resolve, True)
    ]
    assert kinds == ["bypass"]
    kinds = [
        f.kind for f in upstream_findings("POST", b"/v1/./chat/completions", video, resolve, True)
    ]
    assert kinds == ["bypass_path"]
    kinds = [
        f.kind for f in upstream_findings("PUT", b"/v1/chat/completions", video, resolve, True)
    ]
    assert kinds == ["ungated_media"]
    request = HostileRequest(1, "POST", b"/x", [(ID_HEADER, b"fuzz-1")], b"\xff")
    assert HostileRequest.from_json(request.to_json()).body == b"\xff"
    assert UPSTREAM_MARK[0] == b"x-fuzz-upstream"


@pytest.mark.parametrize("raw", [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab"])
def test_a_cut_response_is_a_protocol_failure(raw):
    answer = fuzz_long.parse_response(raw)
    assert answer.problems and answer.problems[0][0] == "protocol"
