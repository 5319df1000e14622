"""Long-run mutation fuzzing of the gateway: hostile HTTP requests, invariants on every answer.

Two targets:

* ``--target asgi`` (default): the whole ``modalgate serve`` stack (request ids,
  the gate, the router, the forwarder, the upstream proxy) built in this process
  by ``create_app`` and called as an ASGI app with hand-made scope, receive and
  send, so thousands of requests a second fit on one core. The proxy's
  connection pool is swapped for a recording upstream in the same process
  (``--app middleware`` instead wraps a recording ASGI app in ``ModalGate``: the
  public API only). Runs ``--workers`` processes.
* ``--target serve``: a real ``modalgate serve --upstream`` subprocess in front of
  a recording upstream subprocess (``hostile.py upstream``), driven over raw
  sockets at ``--concurrency`` (a raw client, because an HTTP library refuses to
  send much of what a hostile client sends).

Every answer must pass: no exception out of the app (asgi) and no traceback in
the gateway's log (serve); exactly one response start and a final body; no hang
(``--timeout``); no 5xx but those the deliberate upstream faults cause; every
non-2xx body is the error envelope with a documented code whose status matches,
and no internals in its messages; and the upstream never receives a media part
the model's rule refuses (a bypass). Failing inputs (the first 20 of each class)
are saved, minimised where the asgi target reproduces them, under ``--save``.

    python tests/corpora/fuzz_long.py --requests 200000 --workers 2 --report fuzz.json
    python tests/corpora/fuzz_long.py --target serve --requests 20000 --concurrency 16
    python tests/corpora/fuzz_long.py --replay /tmp/fuzz_findings/unhandled/0.json

Exit status: 0 when every invariant held, 1 when any failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, run as a script

from corpora.hostile import (  # found through the path above
    FAULT_HEADER,
    ID_HEADER,
    UPSTREAM_MARK,
    Answer,
    Generator,
    HostileRequest,
    check_answer,
    error_code,
    models_list,
    policy_resolver,
    read_body,
    upstream_findings,
    upstream_reply,
)

HERE = Path(__file__).resolve().parent
# The classes that fail a run; the others are counted and reported only.
FAILING = (
    "harness",  # a bug of this script: fix it before believing the rest
    "unhandled",
    "protocol",
    "hang",
    "5xx",
    "envelope",
    "bypass",
    "bypass_path",
    "logged_error",
    "no_response",
)
INFORMATIONAL = ("ungated_media", "server_rejected", "body_changed")
SAVED_PER_CLASS = 20
DEFAULT_SAVE = Path(tempfile.gettempdir()) / "fuzz_findings"
FAKE_UPSTREAM = "http://127.0.0.1:9"  # never dialled: the pool is replaced in process
# The one model the recording upstreams serve (and list on /v1/models): a Kimi-K3
# encoder, which must never see video or audio whatever name a request carries.
DEFAULT_SERVED = "kimi-k3"


# ---------------------------------------------------------------- tallies


@dataclass
class Tally:
    """Counts of one run (or one worker), and the first failing inputs of each class."""

    total: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_code: Counter[str] = field(default_factory=Counter)
    by_class: Counter[str] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)  # type and place, for crashes
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    forwarded: int = 0
    # Failures told apart by what went wrong and where, so 20 samples of the commonest
    # kind cannot hide a rarer one.
    signatures: Counter[str] = field(default_factory=Counter)

    def add(self, request: HostileRequest, answer: Answer) -> None:
        self.total += 1
        self.by_status[str(answer.status)] += 1
        if answer.upstream_status is not None:
            self.forwarded += 1
            self.by_code["(forwarded)"] += 1
        elif answer.status is not None and not 200 <= answer.status < 300:
            self.by_code[error_code(answer.body) or "(not an envelope)"] += 1
        elif answer.status is not None:
            self.by_code["(answered by the gateway)"] += 1
        seen: set[str] = set()
        for kind, detail in answer.problems:
            if kind not in seen:
                seen.add(kind)
                self.add_problem(request, kind, detail, answer)

    def add_problem(
        self, request: HostileRequest, kind: str, detail: str, answer: Answer | None = None
    ) -> None:
        """One broken invariant; the request itself is counted by ``add``."""
        self.by_class[kind] += 1
        if kind not in INFORMATIONAL:
            self.signatures[_signature(kind, detail, request)] += 1
        if kind in ("unhandled", "logged_error"):
            self.exceptions[detail.split("\n", 1)[0][:160]] += 1
        bucket = self.samples.setdefault(kind, [])
        if len(bucket) < SAVED_PER_CLASS:
            bucket.append(
                {
                    "class": kind,
                    "detail": detail[:4000],
                    "status": answer.status if answer is not None else None,
                    "response": answer.body[:2000].decode("utf-8", "replace") if answer else "",
                    "request": request.to_json(),
                }
            )

    def merge(self, other: Tally) -> None:
        self.signatures.update(other.signatures)
        self.total += other.total
        self.forwarded += other.forwarded
        self.by_status.update(other.by_status)
        self.by_code.update(other.by_code)
        self.by_class.update(other.by_class)
        self.exceptions.update(other.exceptions)
        for kind, samples in other.samples.items():
            bucket = self.samples.setdefault(kind, [])
            bucket.extend(samples[: SAVED_PER_CLASS - len(bucket)])

    @property
    def failures(self) -> int:
        return sum(self.by_class[k] for k in FAILING)


def _signature(kind: str, detail: str, request: HostileRequest) -> str:
    """A failure's kind, first line without numbers and quoted input, and the method."""
    line = detail.split("\n", 1)[0]
    if kind in ("bypass", "bypass_path", "ungated_media"):
        line = re.sub(r"model=.*? got", "got", line)
    else:
        line = re.sub(r"b?'[^']*'|\"[^\"]*\"", "...", line)
    return f"{kind}: {request.method} " + re.sub(r"\d+", "N", line)[:160]


# ---------------------------------------------------------------- the in-process upstream


class _Response:
    """Quacks like ``gateway.upstream.pool.UpstreamResponse``: status, raw headers, chunks."""

    def __init__(
        self, status: int, headers: list[tuple[bytes, bytes]], chunks: list[bytes], reset: bool
    ) -> None:
        self.status = status
        self.headers = headers
        self._chunks = chunks
        self._reset = reset

    async def iter_chunks(self) -> Any:
        for index, chunk in enumerate(self._chunks):
            if self._reset and index == 1:
                raise httpx.ReadError("deliberate reset")
            yield chunk
        if self._reset and len(self._chunks) <= 1:
            raise httpx.ReadError("deliberate reset")

    async def aclose(self) -> None:
        return None


class RecordingPool:
    """Stands in for the proxy's ``UpstreamPool``: records what crossed the gate, checks it
    with ``upstream_findings``, answers like a model server (SSE for streams), and fails
    on purpose when the request carries ``x-fuzz-fault``."""

    def __init__(self, mode: str | None, served: str | None = None) -> None:
        self.served = served
        self.resolve, self.refuses_unknown = policy_resolver(mode, served)
        self.seen: dict[str, tuple[bytes, list[tuple[str, str]]]] = {}

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: Any,
        timeouts: dict[str, float | None],
    ) -> _Response:
        if content is None:
            body = b""
        elif isinstance(content, bytes):
            body = content
        else:
            body = b"".join([chunk async for chunk in content])
        named = dict(headers)
        request_id = named.get(ID_HEADER, b"").decode("latin-1")
        raw_path = target.split(b"?", 1)[0]
        findings = upstream_findings(
            method.decode("latin-1"), raw_path, body, self.resolve, self.refuses_unknown
        )
        self.seen[request_id] = (body, [(f.kind, f.detail) for f in findings])
        fault = named.get(FAULT_HEADER, b"").decode("latin-1")
        if fault == "connect":
            raise httpx.ConnectError("deliberate")
        if fault == "timeout":
            raise httpx.ReadTimeout("deliberate")
        if fault == "status500":
            return _Response(
                500,
                [(b"content-type", b"application/json"), UPSTREAM_MARK],
                [b'{"detail":"deliberate"}'],
                False,
            )
        status, reply_headers, chunks = upstream_reply(body)
        return _Response(status, reply_headers, chunks, fault == "reset")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Health probes and model lists: always healthy, listing its one model if any."""
        if request.url.path.endswith("/v1/models"):
            return httpx.Response(200, content=models_list(self.served), request=request)
        return httpx.Response(200, json={}, request=request)

    def release_slot(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class RecordingApp:
    """The app behind ``ModalGate`` in ``--app middleware``: the same recording and reply."""

    def __init__(self, pool: RecordingPool) -> None:
        self.pool = pool

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = await read_body(receive)
        if body is None:
            return
        # Only a 500 of its own: transport faults belong to the proxy, not to an app.
        headers = [(k, v) for k, v in scope["headers"] if k != FAULT_HEADER or v == b"status500"]
        response = await self.pool.request(
            scope["method"].encode(),
            scope.get("raw_path") or scope["path"].encode(),
            headers,
            body,
            {},
        )
        await send(
            {"type": "http.response.start", "status": response.status, "headers": response.headers}
        )
        async for chunk in response.iter_chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


# ---------------------------------------------------------------- errors the app only logs


class LoggedErrors(logging.Handler):
    """Errors logged while a request ran (or by the loop): an exception the app swallowed
    is still a bug. Records are keyed by the request id the gateway set."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_request: dict[str | None, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and record.exc_info is None:
            return
        try:
            from modalgate.gateway.observability.logs import request_id_var

            request_id = request_id_var.get()
        except ImportError:
            request_id = None
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            text = _exception_text(record.exc_info[1]) + " (logged by " + text + ")"
        self.by_request.setdefault(request_id, []).append(text)


def _exception_text(exc: BaseException) -> str:
    """Type, message and innermost frame: enough to tell crashes apart."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        where = f" at {Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return (
        f"{type(exc).__name__}: {str(exc)[:200]}{where}\n"
        + "".join(traceback.format_exception(exc))[-3000:]
    )


# ---------------------------------------------------------------- the asgi target


def _capture_logging(handler: LoggedErrors) -> Callable[[], None]:
    """Catch error records from the app, keep its INFO lines quiet; returns the undo (the
    tests run in a process other tests share)."""
    root = logging.getLogger()
    loggers = [logging.getLogger(name) for name in ("modalgate", "asyncio")]
    levels = [logger.level for logger in loggers]
    root.addHandler(handler)
    for logger in loggers:
        logger.setLevel(logging.WARNING)

    def undo() -> None:
        root.removeHandler(handler)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)

    return undo


class AsgiTarget:
    """The app under test, its recording upstream, and one ASGI call per request."""

    def __init__(
        self,
        mode: str | None,
        app_kind: str,
        timeout_s: float,
        wrap: Callable[[RecordingApp], Any] | None = None,
        served: str | None = DEFAULT_SERVED,
    ) -> None:
        self.mode = mode
        self.timeout_s = timeout_s
        self.served = served
        self.pool = RecordingPool(mode, served)
        self.errors = LoggedErrors()
        self._undo_logging = _capture_logging(self.errors)
        if wrap is not None:  # any gate around the recording app (the harness's self-test)
            self.app: Any = wrap(RecordingApp(self.pool))
        elif app_kind == "middleware":
            from modalgate import ModalGate

            self.app = ModalGate(
                RecordingApp(self.pool), policy=None, mode=mode, served_model=served
            )
        else:
            from modalgate.gateway.app import create_app
            from modalgate.gateway.settings import GatewaySettings

            settings = GatewaySettings(
                mode=mode,
                upstream=FAKE_UPSTREAM,
                access_log=False,
                watch_policy=False,
                log_level="warning",
            )
            gateway = create_app(settings=settings)
            targets = getattr(getattr(gateway, "upstreams", None), "targets", None)
            if not targets:
                raise RuntimeError(
                    "the gateway's upstream pool is not where this harness looks for it "
                    "(Gateway.upstreams.targets[*].proxy.transport); use --app middleware"
                )
            for target in targets.values():
                target.proxy.transport = self.pool
            self.app = gateway
            self._targets = list(targets.values())
        self._lifespan: asyncio.Task[None] | None = None
        self._targets: list[Any] = getattr(self, "_targets", [])
        self._lifespan_queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._lifespan_sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._lifespan = asyncio.ensure_future(
            self.app(scope, self._lifespan_queue.get, self._lifespan_sent.put)
        )
        await self._lifespan_queue.put({"type": "lifespan.startup"})
        message = await asyncio.wait_for(self._lifespan_sent.get(), 30)
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {message}")
        # The gateway reads what its upstream serves in the background: wait for it, so
        # the first requests are judged as the later ones are.
        for _ in range(100):
            if not self.served or all(getattr(t, "served", True) for t in self._targets):
                break
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        try:
            if self._lifespan is None:
                return
            await self._lifespan_queue.put({"type": "lifespan.shutdown"})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lifespan_sent.get(), 10)
            self._lifespan.cancel()
            with contextlib.suppress(BaseException):
                await self._lifespan
        finally:
            self._undo_logging()

    async def call(self, request: HostileRequest) -> Answer:
        """One request through the app; the answer carries every broken invariant."""
        raw_path = request.raw_path
        path = raw_path.decode("latin-1")
        if "%" in path:  # what uvicorn puts in scope["path"]
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": request.query,
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1:8000"), *request.headers],
            "client": ("127.0.0.1", 40000 + request.index % 20000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        body = request.body
        pieces: list[bytes] = []
        offset = 0
        for size in request.chunks:
            pieces.append(body[offset : offset + size])
            offset += size
        if offset < len(body) or not pieces:
            pieces.append(body[offset:])
        done = asyncio.Event()
        delivered = 0
        answer = Answer(None, [], b"")
        started = finished = False
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if delivered < len(pieces):
                delivered += 1
                more = delivered < len(pieces)
                return {"type": "http.request", "body": pieces[delivered - 1], "more_body": more}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal started, finished
            kind = message.get("type")
            if kind == "http.response.start":
                if started:
                    answer.problems.append(("protocol", "a second http.response.start"))
                started = True
                status = message.get("status")
                headers = message.get("headers", [])
                if not isinstance(status, int) or not 100 <= status <= 599:
                    answer.problems.append(("protocol", f"status {status!r}"))
                if not all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in headers):
                    answer.problems.append(("protocol", "a header that is not (bytes, bytes)"))
                answer.status = status
                answer.headers = list(headers)
            elif kind == "http.response.body":
                if not started:
                    answer.problems.append(("protocol", "a body before the response start"))
                if finished:
                    answer.problems.append(("protocol", "a message after the final body"))
                chunk = message.get("body", b"")
                if not isinstance(chunk, bytes):
                    answer.problems.append(("protocol", f"a body of type {type(chunk).__name__}"))
                    chunk = bytes(chunk or b"")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    finished = True
                    done.set()
            else:
                answer.problems.append(("protocol", f"an unexpected message {kind!r}"))

        request_id = request.request_id
        try:
            await asyncio.wait_for(self.app(scope, receive, send), self.timeout_s)
        except asyncio.TimeoutError:
            answer.problems.append(("hang", f"no answer within {self.timeout_s:g} s"))
        except Exception as exc:  # the point: the app must raise nothing
            frames = traceback.extract_tb(exc.__traceback__)
            ours = bool(frames) and Path(frames[-1].filename).parent == HERE
            answer.problems.append(("harness" if ours else "unhandled", _exception_text(exc)))
        finally:
            done.set()
        answer.body = b"".join(chunks)
        crashed = any(k in ("hang", "unhandled", "harness") for k, _ in answer.problems)
        if not started and not crashed:
            answer.problems.append(("protocol", "the app returned without a response"))
        elif started and not finished and not crashed and request.fault != "reset":
            answer.problems.append(("protocol", "the app returned without a final body"))
        if UPSTREAM_MARK in answer.headers:
            answer.upstream_status = answer.status
        seen = self.pool.seen.pop(request_id, None)
        if seen is not None:
            forwarded, findings = seen
            answer.problems.extend(findings)
            if (
                answer.upstream_status is not None
                and forwarded != request.body
                and request.method == "POST"
            ):
                answer.problems.append(("body_changed", f"{len(request.body)} -> {len(forwarded)}"))
        for text in self.errors.by_request.pop(request_id, []):
            answer.problems.append(("logged_error", text))
        check_answer(request, answer)
        return answer


async def run_asgi(
    seed: int,
    start: int,
    stop: int,
    step: int,
    mode: str | None,
    app_kind: str,
    timeout_s: float,
    deadline: float,
    concurrency: int,
    progress: Callable[[Tally], None] | None = None,
    wrap: Callable[[RecordingApp], Any] | None = None,
    served: str | None = DEFAULT_SERVED,
) -> Tally:
    """Requests ``start, start+step, ... < stop`` of ``seed`` through one in-process app."""
    target = AsgiTarget(mode, app_kind, timeout_s, wrap, served)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(
        lambda _loop, context: target.errors.by_request.setdefault(None, []).append(
            f"loop: {context.get('message')} {context.get('exception')!r}"
        )
    )
    await target.start()
    generator = Generator(seed)
    tally = Tally()
    indexes = iter(range(start, stop, step))
    last_progress = time.monotonic()

    async def worker() -> None:
        nonlocal last_progress
        for index in indexes:
            if time.monotonic() > deadline:
                return
            request = generator.request(index)
            answer = await target.call(request)
            tally.add(request, answer)
            if progress is not None and time.monotonic() - last_progress > 10:
                last_progress = time.monotonic()
                progress(tally)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await target.stop()
    stray = target.errors.by_request.pop(None, [])
    for text in stray:
        tally.add_problem(HostileRequest(-1, "-", b"-", [], b""), "logged_error", text)
    return tally


def _asgi_worker(args: tuple[Any, ...]) -> Tally:
    """One process of the asgi target (multiprocessing's entry point)."""
    seed, start, stop, step, mode, app_kind, timeout_s, deadline, concurrency, verbose, served = (
        args
    )
    _use_uvloop()

    def progress(tally: Tally) -> None:
        if verbose:
            print(
                f"  worker {start}: {tally.total} requests, failures {dict(tally.by_class)}",
                file=sys.stderr,
                flush=True,
            )

    return asyncio.run(
        run_asgi(
            seed,
            start,
            stop,
            step,
            mode,
            app_kind,
            timeout_s,
            deadline,
            concurrency,
            progress,
            served=served,
        )
    )


def _use_uvloop() -> None:
    """The gateway runs on uvloop under ``modalgate serve``; so do we, when it is there."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def fuzz_asgi(
    requests: int,
    seed: int,
    workers: int,
    mode: str | None,
    app_kind: str = "gateway",
    timeout_s: float = 10.0,
    max_seconds: float | None = None,
    concurrency: int = 8,
    verbose: bool = False,
    served: str | None = DEFAULT_SERVED,
) -> Tally:
    """Run ``requests`` requests of ``seed`` in-process, split over ``workers`` processes."""
    deadline = time.monotonic() + (max_seconds or 1e12)
    jobs = [
        (
            seed,
            index,
            requests,
            workers,
            mode,
            app_kind,
            timeout_s,
            deadline,
            concurrency,
            verbose,
            served,
        )
        for index in range(workers)
    ]
    tally = Tally()
    if workers == 1:
        tally.merge(_asgi_worker(jobs[0]))
        return tally
    context = multiprocessing.get_context("spawn")  # no inherited event loop or threads
    with context.Pool(workers) as pool:
        for part in pool.imap_unordered(_asgi_worker, jobs):
            tally.merge(part)
    return tally


# ---------------------------------------------------------------- the serve target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout_s:g} s")


def _temp_path(prefix: str, suffix: str) -> Path:
    with tempfile.NamedTemporaryFile(prefix=prefix, suffix=suffix, delete=False) as file:
        return Path(file.name)


@dataclass
class ServeStack:
    """A recording upstream process and ``modalgate serve`` in front of it, on 127.0.0.1."""

    mode: str | None
    upstream_command: list[str] | None = None  # gets --port P appended
    served: str | None = DEFAULT_SERVED  # the recording upstream's one model
    gateway_args: list[str] = field(default_factory=list)
    upstream_ready_path: str = "/_fuzz/findings"
    log_path: Path = field(default_factory=lambda: _temp_path("modalgate-fuzz-", ".log"))

    def __enter__(self) -> ServeStack:
        self.upstream_port = free_port()
        self.port = free_port()
        here = Path(__file__).resolve().parent
        command = self.upstream_command or [
            sys.executable,
            str(here / "hostile.py"),
            "upstream",
            "--mode",
            self.mode or "",
            "--served",
            self.served or "",
        ]
        command = [*command, "--port", str(self.upstream_port)]
        self.upstream = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._log = self.log_path.open("wb")
        gateway = [
            sys.executable,
            "-m",
            "modalgate.gateway.cli",
            "serve",
            "--port",
            str(self.port),
            "--upstream",
            f"http://127.0.0.1:{self.upstream_port}",
            "--log-format",
            "json",
            "--no-watch-policy",
            *(["--mode", self.mode] if self.mode else []),
            *self.gateway_args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.gateway = subprocess.Popen(
            gateway, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        try:
            wait_http(
                f"http://127.0.0.1:{self.upstream_port}{self.upstream_ready_path}", self.upstream
            )
            wait_http(f"http://127.0.0.1:{self.port}/healthz", self.gateway)
            # The gateway learns what its upstream serves from this list: read it first.
            httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=10)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for process in (self.gateway, self.upstream):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in (self.gateway, self.upstream):
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        self._log.close()

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text("utf-8", errors="replace")


async def raw_exchange(
    host: str, port: int, request: HostileRequest, timeout_s: float
) -> tuple[Answer, float]:
    """Send one request as raw bytes on a fresh connection; read the whole response."""
    started = time.perf_counter()
    head = [f"{request.method} {request.target.decode('latin-1')} HTTP/1.1".encode()]
    head.append(f"host: {host}:{port}".encode())
    head += [name + b": " + value for name, value in request.headers]
    chunked = bool(request.chunks) and not any(n == b"content-length" for n, _ in request.headers)
    if chunked:
        head.append(b"transfer-encoding: chunked")
    head.append(b"connection: close")
    payload = b"\r\n".join(head) + b"\r\n\r\n"
    if chunked:
        offset = 0
        for size in request.chunks:
            if size:
                payload += f"{size:x}\r\n".encode() + request.body[offset : offset + size] + b"\r\n"
            offset += size
        payload += b"0\r\n\r\n"
    else:
        payload += request.body

    async def exchange() -> bytes:
        """Read while sending, as curl does: a server may answer early (a refusal from
        headers alone) and close before the body is all out; that answer still counts."""
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)

        async def sender() -> None:
            with contextlib.suppress(OSError):
                await loop.sock_sendall(sock, payload)

        sending: asyncio.Future[None] | None = None
        chunks: list[bytes] = []
        try:
            await loop.sock_connect(sock, (host, port))
            sending = asyncio.ensure_future(sender())
            while True:
                try:
                    data = await loop.sock_recv(sock, 65536)
                except ConnectionResetError:
                    if chunks:
                        break
                    raise
                if not data:
                    break
                chunks.append(data)
        finally:
            if sending is not None:
                sending.cancel()
                with contextlib.suppress(BaseException):
                    await sending
            sock.close()
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(exchange(), timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        return Answer(None, [], b"", [("hang", f"no complete answer within {timeout_s:g} s")]), (
            time.perf_counter() - started
        )
    except OSError as exc:
        return Answer(None, [], b"", [("no_response", f"{type(exc).__name__}: {exc}")]), (
            time.perf_counter() - started
        )
    elapsed = time.perf_counter() - started
    return parse_response(raw, request.method), elapsed


def parse_response(raw: bytes, method: str = "POST") -> Answer:
    """An HTTP/1.1 response read to the connection's close (no body for HEAD, 204, 304)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return Answer(None, [], b"", [("no_response", f"the connection closed: {raw[:200]!r}")])
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split(b" ", 2)[1])
    except (IndexError, ValueError):
        return Answer(None, [], b"", [("no_response", f"not HTTP: {lines[0][:200]!r}")])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    named = dict(headers)
    body = rest
    problems: list[tuple[str, str]] = []
    if method.upper() == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return Answer(status, headers, b"", problems)
    if named.get(b"transfer-encoding", b"").lower() == b"chunked":
        body, complete = _dechunk(rest)
        if not complete:
            problems.append(("protocol", "a chunked body cut before its last chunk"))
    elif b"content-length" in named and named[b"content-length"].isdigit():
        length = int(named[b"content-length"])
        if len(rest) < length:
            problems.append(("protocol", f"{len(rest)} of {length} body bytes"))
        body = rest[:length]
    return Answer(status, headers, body, problems)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out = bytearray()
    while True:
        line, sep, data = data.partition(b"\r\n")
        if not sep:
            return bytes(out), False
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            return bytes(out), False
        if size == 0:
            return bytes(out), True
        out += data[:size]
        data = data[size + 2 :]


# serve's protocol refusing bytes that are not HTTP/1.1 (gateway/http/connection.py ``malformed``).
SERVER_REJECTION = b'"message":"the request is not valid HTTP/1.1: '


async def fuzz_serve_async(
    stack: ServeStack,
    requests: int,
    seed: int,
    concurrency: int,
    timeout_s: float,
    deadline: float,
    verbose: bool,
) -> Tally:
    generator = Generator(seed, http_safe=True)
    tally = Tally()
    indexes = iter(range(requests))
    last = time.monotonic()

    async def worker() -> None:
        nonlocal last
        for index in indexes:
            if time.monotonic() > deadline:
                return
            request = generator.request(index)
            answer, _ = await raw_exchange("127.0.0.1", stack.port, request, timeout_s)
            if answer.status == 400 and SERVER_REJECTION in answer.body:
                answer.problems.append(("server_rejected", "llhttp refused the request"))
            else:
                if UPSTREAM_MARK in answer.headers:
                    answer.upstream_status = answer.status
                check_answer(request, answer)
            tally.add(request, answer)
            if verbose and time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"  {tally.total} requests, {dict(tally.by_class)}", file=sys.stderr)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


_TRACE_MARKERS = re.compile(r"Traceback|Exception in ASGI application|\"exc_type\"")


def scan_gateway_log(text: str) -> list[tuple[str | None, str]]:
    """Tracebacks and error-level lines in the gateway's log, with their request ids."""
    found: list[tuple[str | None, str]] = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                level = str(record.get("level", "")).lower()
                if level in ("error", "critical") or "exc_type" in record:
                    found.append((record.get("request_id"), line[:3000]))
                continue
        if _TRACE_MARKERS.search(line):
            found.append((None, line[:3000]))
    return found


def fuzz_serve(
    requests: int,
    seed: int,
    mode: str | None,
    concurrency: int,
    timeout_s: float,
    max_seconds: float | None,
    verbose: bool,
    served: str | None = DEFAULT_SERVED,
) -> Tally:
    deadline = time.monotonic() + (max_seconds or 1e12)
    with ServeStack(mode, served=served) as stack:
        tally = asyncio.run(
            fuzz_serve_async(stack, requests, seed, concurrency, timeout_s, deadline, verbose)
        )
        time.sleep(0.5)  # the last log lines
        findings = httpx.get(
            f"http://127.0.0.1:{stack.upstream_port}/_fuzz/findings", timeout=30
        ).json()
        log = stack.log_text()
    generator = Generator(seed, http_safe=True)
    for finding in findings["findings"]:
        request = _request_of(generator, finding.get("request_id"))
        tally.add_problem(request, finding["kind"], finding["detail"])
    for request_id, line in scan_gateway_log(log):
        tally.add_problem(_request_of(generator, request_id), "logged_error", line)
    return tally


def _request_of(generator: Generator, request_id: str | None) -> HostileRequest:
    if request_id and request_id.startswith("fuzz-") and request_id[5:].isdigit():
        return generator.request(int(request_id[5:]))
    return HostileRequest(-1, "-", b"-", [], b"", notes=[f"request id {request_id!r}"])


# ---------------------------------------------------------------- minimising and saving


def replay(
    request: HostileRequest,
    mode: str | None,
    app_kind: str = "gateway",
    served: str | None = DEFAULT_SERVED,
) -> Answer:
    """One request through a fresh in-process app (for ``--replay``)."""

    async def once() -> Answer:
        target = AsgiTarget(mode, app_kind, 10.0, served=served)
        await target.start()
        try:
            return await target.call(request)
        finally:
            await target.stop()

    return asyncio.run(once())


class Minimiser:
    """Shrinks a failing request while the same class of failure (the same exception type
    for crashes) still happens: headers, path and chunking first, then the JSON body."""

    def __init__(
        self, mode: str | None, app_kind: str, served: str | None, budget: int = 400
    ) -> None:
        self.mode = mode
        self.budget = budget
        self.loop = asyncio.new_event_loop()
        self.target = self.loop.run_until_complete(self._target(mode, app_kind, served))

    @staticmethod
    async def _target(mode: str | None, app_kind: str, served: str | None) -> AsgiTarget:
        target = AsgiTarget(mode, app_kind, 10.0, served=served)
        await target.start()
        return target

    def close(self) -> None:
        self.loop.run_until_complete(self.target.stop())
        self.loop.close()

    def _signature(self, answer: Answer, kind: str) -> str | None:
        for problem, detail in answer.problems:
            if problem == kind:
                if kind in ("unhandled", "logged_error"):
                    return problem + ":" + detail.split(":", 1)[0]
                return problem
        return None

    def fails(self, request: HostileRequest, signature: str, kind: str) -> bool:
        if self.budget <= 0:
            return False
        self.budget -= 1
        answer = self.loop.run_until_complete(self.target.call(request))
        return self._signature(answer, kind) == signature

    def minimise(self, request: HostileRequest, kind: str) -> HostileRequest | None:
        answer = self.loop.run_until_complete(self.target.call(request))
        signature = self._signature(answer, kind)
        if signature is None:
            return None  # does not reproduce in process
        current = request
        for candidate in self._http_candidates(current):
            if self.fails(candidate, signature, kind):
                current = candidate
        try:
            tree = json.loads(current.body)
        except (ValueError, RecursionError):
            return current
        if not isinstance(tree, (dict, list)):
            return current
        rebuilt = self._with_body(current, _dumps(tree))
        if not self.fails(rebuilt, signature, kind):
            return current  # the failure lives in bytes a re-serialisation loses
        current = rebuilt
        changed = True
        while changed and self.budget > 0:
            changed = False
            for smaller in _smaller_trees(tree):
                candidate = self._with_body(current, _dumps(smaller))
                if self.fails(candidate, signature, kind):
                    tree, current, changed = smaller, candidate, True
                    break
        return current

    @staticmethod
    def _with_body(request: HostileRequest, body: bytes) -> HostileRequest:
        headers = [
            (k, str(len(body)).encode() if k == b"content-length" else v)
            for k, v in request.headers
        ]
        return HostileRequest(
            request.index,
            request.method,
            request.target,
            headers,
            body,
            [],
            request.fault,
            request.notes,
        )

    @staticmethod
    def _http_candidates(request: HostileRequest) -> list[HostileRequest]:
        out = []
        base = HostileRequest(
            request.index,
            request.method,
            request.target,
            list(request.headers),
            request.body,
            [],
            request.fault,
            request.notes,
        )
        out.append(base)
        for name, _ in request.headers:
            if name not in (ID_HEADER, b"content-length"):
                out.append(
                    HostileRequest(
                        base.index,
                        base.method,
                        base.target,
                        [(k, v) for k, v in base.headers if k != name],
                        base.body,
                        [],
                        base.fault,
                        base.notes,
                    )
                )
        return out


def _dumps(tree: Any) -> bytes:
    return json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()


def _smaller_trees(tree: Any) -> Any:
    """Each variant with one list item or dict key removed, or one long string cut."""
    nodes: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack and len(nodes) < 300:
        value = stack.pop()
        if isinstance(value, dict):
            for key in list(value):
                nodes.append((value, key))
                stack.append(value[key])
        elif isinstance(value, list):
            for index in range(len(value)):
                nodes.append((value, index))
                stack.append(value[index])
    for container, key in nodes:
        original = container[key]
        if isinstance(container, dict):
            del container[key]
            yield json.loads(_dumps(tree))
            container[key] = original
        else:
            del container[key]
            yield json.loads(_dumps(tree))
            container.insert(key, original)
        if isinstance(original, (dict, list)) and original:
            container[key] = {} if isinstance(original, dict) else []
            yield json.loads(_dumps(tree))
            container[key] = original
        if isinstance(original, str) and len(original) > 64 and not original.startswith("data:"):
            container[key] = original[:32]
            yield json.loads(_dumps(tree))
            container[key] = original


def save_samples(
    tally: Tally,
    folder: Path,
    mode: str | None,
    app_kind: str,
    minimise: bool,
    served: str | None = DEFAULT_SERVED,
) -> None:
    """The first failing inputs of each class, one JSON file each, minimised when they
    reproduce in process."""
    folder.mkdir(parents=True, exist_ok=True)
    minimiser = Minimiser(mode, app_kind, served) if minimise else None
    try:
        for kind, samples in tally.samples.items():
            where = folder / kind
            where.mkdir(exist_ok=True)
            for number, sample in enumerate(samples):
                if minimiser is not None and sample["request"]["index"] >= 0 and number < 5:
                    minimiser.budget = 400
                    request = HostileRequest.from_json(sample["request"])
                    with contextlib.suppress(Exception):
                        small = minimiser.minimise(request, kind)
                        if small is not None:
                            sample["minimal"] = small.to_json()
                (where / f"{number}.json").write_text(json.dumps(sample, indent=1))
    finally:
        if minimiser is not None:
            minimiser.close()


# ---------------------------------------------------------------- report


def report_of(tally: Tally, wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "target": args.target,
        "app": args.app,
        "mode": args.mode,
        "served": args.served,
        "seed": args.seed,
        "total": tally.total,
        "forwarded": tally.forwarded,
        "by_status": dict(tally.by_status.most_common()),
        "by_error_code": dict(tally.by_code.most_common()),
        "failures": {k: tally.by_class[k] for k in FAILING},
        "informational": {k: tally.by_class[k] for k in INFORMATIONAL},
        "unhandled_exceptions": tally.by_class["unhandled"],
        "5xx": tally.by_class["5xx"],
        "hangs": tally.by_class["hang"],
        "envelope_violations": tally.by_class["envelope"],
        "bypasses": tally.by_class["bypass"] + tally.by_class["bypass_path"],
        "exception_kinds": dict(tally.exceptions.most_common(50)),
        "failure_signatures": dict(tally.signatures.most_common(60)),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(tally.total / wall_s, 1) if wall_s else None,
    }


def print_summary(report: dict[str, Any], tally: Tally) -> None:
    print(
        f"{report['total']} requests in {report['wall_s']} s "
        f"({report['requests_per_s']} requests/s), {report['forwarded']} forwarded upstream"
    )
    print("by status:", report["by_status"])
    print("by error code:", report["by_error_code"])
    print("failures:", report["failures"])
    print("informational:", report["informational"])
    for kind, samples in tally.samples.items():
        first = samples[0]
        print(f"  {kind}: e.g. request {first['request']['index']}: {first['detail'][:300]!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--target", choices=("asgi", "serve"), default="asgi")
    parser.add_argument("--app", choices=("gateway", "middleware"), default="gateway")
    parser.add_argument("--requests", type=int, default=None, help="default 1e6 asgi, 2e4 serve")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="processes (asgi)")
    parser.add_argument("--concurrency", type=int, default=None, help="default 8 asgi, 16 serve")
    parser.add_argument("--mode", default="encoder", help="'' for no mode (full models)")
    parser.add_argument(
        "--served",
        default=DEFAULT_SERVED,
        help="the one model the recording upstream serves and lists ('' for none: the gate "
        "judges by name, and so does the bypass check)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="per request, seconds")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop early")
    parser.add_argument("--report", type=Path, help="write the counts as JSON here")
    parser.add_argument("--save", type=Path, default=DEFAULT_SAVE, help="failing inputs")
    parser.add_argument("--no-minimise", action="store_true")
    parser.add_argument("--replay", type=Path, help="send one saved input again (asgi)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    mode = args.mode or None
    served = args.served or None
    if args.replay is not None:
        saved = json.loads(args.replay.read_text())
        request = HostileRequest.from_json(saved.get("minimal") or saved.get("request") or saved)
        answer = replay(request, mode, args.app, served)
        print(json.dumps({"status": answer.status, "problems": answer.problems}, indent=1))
        print(answer.body[:2000].decode("utf-8", "replace"))
        return 1 if any(k in FAILING for k, _ in answer.problems) else 0
    started = time.monotonic()
    if args.target == "asgi":
        requests = args.requests if args.requests is not None else 1_000_000
        tally = fuzz_asgi(
            requests,
            args.seed,
            max(1, args.workers),
            mode,
            args.app,
            args.timeout,
            args.max_seconds,
            args.concurrency or 8,
            args.verbose,
            served,
        )
    else:
        requests = args.requests if args.requests is not None else 20_000
        tally = fuzz_serve(
            requests,
            args.seed,
            mode,
            args.concurrency or 16,
            args.timeout,
            args.max_seconds,
            args.verbose,
            served,
        )
    wall = time.monotonic() - started
    report = report_of(tally, wall, args)
    print_summary(report, tally)
    if tally.samples:
        save_samples(tally, args.save, mode, args.app, not args.no_minimise, served)
        print(f"failing inputs: {args.save}/<class>/<n>.json")
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
