"""SIGTERM to a real ``modalgate serve``: ``/readyz`` turns 503 "draining" at once, the
request in flight still finishes, then the process exits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from conftest import chat, serve
from gateway_proc import MODALGATE, GatewayProcess

TIMEOUT_S = 20


class HeldUpstream:
    """Answers chat only when the test lets it: a request that stays in flight."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._models, methods=["GET"]),
            ]
        )

    async def _chat(self, request: Request) -> JSONResponse:
        await request.body()
        self.arrived.set()
        await anyio.to_thread.run_sync(self.release.wait, TIMEOUT_S)
        return JSONResponse({"object": "chat.completion", "choices": []})

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "held", "object": "model"}]})


@pytest.fixture
def held() -> Iterator[tuple[HeldUpstream, str]]:
    upstream = HeldUpstream()
    with serve(upstream.app()) as base:
        yield upstream, base
    upstream.release.set()


def chat_in_background(url: str) -> tuple[threading.Thread, list[httpx.Response]]:
    """A chat request running in a thread; its answer lands in the list."""
    answers: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: answers.append(
            httpx.post(url + "/v1/chat/completions", json=chat(), timeout=TIMEOUT_S)
        )
    )
    client.start()
    return client, answers


def test_sigterm_drains_readyz_says_so_and_the_request_in_flight_finishes(held):
    upstream, base = held
    with GatewayProcess("--upstream", base, "--grace-period", "30") as gateway:
        assert httpx.get(gateway.url + "/readyz").status_code == 200
        client, answers = chat_in_background(gateway.url)
        assert upstream.arrived.wait(TIMEOUT_S)
        gateway.signal(signal.SIGTERM)
        line = gateway.wait_for_log(lambda line: line.get("event") == "draining")
        assert line["in_flight"] == 1
        ready = httpx.get(gateway.url + "/readyz")
        assert (ready.status_code, ready.json()) == (
            503,
            {"status": "not_ready", "reason": "draining"},
        )
        assert httpx.get(gateway.url + "/healthz").status_code == 200  # still answering
        assert gateway.process.poll() is None
        upstream.release.set()
        client.join(TIMEOUT_S)
        assert [answer.status_code for answer in answers] == [200]
        gateway.process.wait(TIMEOUT_S)  # the drain ends with the last request


def test_with_nothing_in_flight_sigterm_stops_at_once(held):
    _, base = held
    with GatewayProcess("--upstream", base, "--grace-period", "30") as gateway:
        gateway.signal(signal.SIGTERM)
        gateway.process.wait(TIMEOUT_S)  # well within the 30 s grace period
        assert "draining" in gateway.text()


def in_own_group(*args: str) -> list[str]:
    """``modalgate serve`` as the leader of its own process group, so that the test can
    signal the group as a terminal's Ctrl-C or systemd's ``KillMode=control-group`` does."""
    start = "import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    return [sys.executable, "-c", start, *MODALGATE[1:], "serve", "--port", "{port}", *args]


def test_a_group_signal_then_the_parents_sigterm_still_drains_every_worker(held):
    # Ctrl-C reaches each worker, then uvicorn's parent sends each one SIGTERM: the second
    # signal, within a second of the first, does not cut the drain short.
    upstream, base = held
    command = in_own_group("--upstream", base, "--grace-period", "30", "--workers", "2")
    with GatewayProcess(command=command) as gateway:
        client, answers = chat_in_background(gateway.url)
        assert upstream.arrived.wait(TIMEOUT_S)
        os.killpg(gateway.process.pid, signal.SIGINT)
        gateway.wait_for_log(lambda line: line.get("event") == "draining")
        time.sleep(2)  # past the second uvicorn gives requests once its own shutdown starts
        assert client.is_alive()
        assert gateway.process.poll() is None
        upstream.release.set()
        client.join(TIMEOUT_S)
        assert [answer.status_code for answer in answers] == [200]
        gateway.process.wait(TIMEOUT_S)


def post_and_forget(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):  # cut off when the gateway stops
        httpx.post(url + "/v1/chat/completions", json=chat(), timeout=TIMEOUT_S)


def test_a_second_sigint_after_a_second_skips_the_wait(held):
    upstream, base = held
    with GatewayProcess("--upstream", base, "--grace-period", "30") as gateway:
        client = threading.Thread(target=post_and_forget, args=(gateway.url,))
        client.start()
        assert upstream.arrived.wait(TIMEOUT_S)
        gateway.signal(signal.SIGINT)
        gateway.wait_for_log(lambda line: line.get("event") == "draining")
        time.sleep(1.2)
        gateway.signal(signal.SIGTERM)  # a repeated SIGTERM does not, as under uvicorn
        time.sleep(1.5)  # past the second uvicorn's own shutdown would give it
        assert gateway.process.poll() is None
        gateway.signal(signal.SIGINT)
        gateway.process.wait(10)  # the request still held: the drain was cut short
        assert upstream.release.is_set() is False
        upstream.release.set()
        client.join(TIMEOUT_S)
