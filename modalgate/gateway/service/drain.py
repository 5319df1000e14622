"""Graceful shutdown that load balancers can see: on SIGTERM, ``/readyz`` turns 503
("draining") at once, while the gateway keeps answering until the requests in flight
have finished (at most the grace period); then the server's own shutdown runs.

Without it, uvicorn closes its listening socket on the signal: a balancer's next
probe meets a refused connection, and requests already routed here are refused
too. A second SIGINT skips the wait, as a second SIGINT forces uvicorn's exit (a
repeated SIGTERM does not); but a signal within ``REPEAT_WINDOW_S`` of the first is the
same shutdown told twice and is ignored: under ``--workers`` a group signal (Ctrl-C,
systemd's ``KillMode=control-group``) reaches each worker, and then uvicorn's parent
sends it SIGTERM.

The hook wraps the server's own signal handler, so it is installed only where
``modalgate serve`` runs the app (``enabled``), from the lifespan startup on the
main thread, after uvicorn has installed its handlers; under other servers
shutdown is theirs (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modalgate.gateway.service.health import Readiness

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0  # a second signal sooner than this is the first one relayed
logger = logging.getLogger("modalgate.gateway")
SignalHandler = Callable[[int, FrameType | None], Any]


class Drain:
    """Counts the HTTP requests in flight; on the first signal, drains them."""

    def __init__(self, app: ASGIApp, readiness: Readiness, grace_period_s: float) -> None:
        self.app = app
        self.readiness = readiness
        self.grace_period_s = grace_period_s
        self.enabled = False  # set by ``modalgate serve``: the server's handlers are uvicorn's
        self.in_flight = 0
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._handed_over = False
        self._first_signal_at: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.in_flight -= 1
                if not self.in_flight and self._idle is not None:
                    self._idle.set()
            return
        if scope["type"] == "lifespan" and self.enabled:
            send = self._installing_after_startup(send)
        await self.app(scope, receive, send)

    def _installing_after_startup(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.install()
            await send(message)

        return wrapped

    def install(self) -> None:
        """Put the drain in front of the server's handler of each signal (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for number in DRAIN_SIGNALS:
            server_handler = signal.getsignal(number)
            if callable(server_handler):
                signal.signal(number, self._handler(loop, server_handler))

    def _handler(self, loop: asyncio.AbstractEventLoop, server: SignalHandler) -> SignalHandler:
        def on_signal(number: int, frame: FrameType | None) -> None:
            now = time.monotonic()
            if self._first_signal_at is None:
                self._first_signal_at = now
                if not self.grace_period_s:
                    self._handed_over = True
                    server(number, frame)  # no grace: the server's way, now
                    return
                self.readiness.draining = True
                loop.call_soon_threadsafe(self._start, server, number, frame)
                return
            if now - self._first_signal_at < REPEAT_WINDOW_S:
                return  # the first signal again: a group signal, then the parent's SIGTERM
            if self._handed_over:
                server(number, frame)  # the server's shutdown is under way: its convention
            elif number == signal.SIGINT:
                self._handed_over = True
                server(number, frame)  # a second Ctrl-C: skip the wait

        return on_signal

    def _start(self, server: SignalHandler, number: int, frame: FrameType | None) -> None:
        logger.info(
            "draining",
            extra={"fields": {"in_flight": self.in_flight, "grace_period_s": self.grace_period_s}},
        )
        self._task = asyncio.get_running_loop().create_task(self._drain(server, number, frame))

    async def _drain(self, server: SignalHandler, number: int, frame: FrameType | None) -> None:
        if self.in_flight:
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.grace_period_s)
        if not self._handed_over:
            self._handed_over = True
            server(number, frame)
