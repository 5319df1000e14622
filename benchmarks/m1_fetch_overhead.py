"""M1: ``MediaFetcher.fetch(url)`` vs a plain ``httpx.AsyncClient().get(url)`` of the same URL.

A stdlib ``ThreadingHTTPServer`` runs in a separate process (this script with
``--serve DIR``), so the server never shares the client's GIL. It listens on
127.0.0.1, keeps connections alive (HTTP/1.1, TCP_NODELAY) and serves two real
images made with Pillow from memory: a ~500 KB JPEG and a ~22 KB RGBA PNG.
Server and client are pinned to one CPU each (``--no-pin`` leaves them be).

The fetcher runs under ``MediaUrls(schemes=("http",), allow_private=(127.0.0.1/32,))``
and does everything it does for any URL: the URL rules, the address check, the
pinned connect, the content-type and byte-cap checks while reading. The plain
client is ``httpx.AsyncClient(trust_env=False)`` (the fetcher ignores proxy
variables too) reading the whole body. Both clients are created once and reused,
so both keep their connections alive. Before timing, both must return the
served bytes, and a fetcher without ``allow_private`` must refuse the URL.

Four variants, each in interleaved rounds (the order flips every round): each
image, fetched sequentially and with 8 requests in flight (8 tasks). A timed
call is a batch of fetches; per round the median of the reps of each.

Ratio = fetcher time / plain httpx time, per variant. Target: <= 1.25 for every
variant; the RESULT line carries the largest of the four medians.

With ``--profile`` (or for a variant that misses the target) both clients are
run under cProfile and the functions where the fetcher spends more time are
listed, with httpcore's connection-pool retries per fetch.

Usage: .venv/bin/python benchmarks/m1_fetch_overhead.py [--quick] [--profile] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import ipaddress
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
from _common import Rounds, interleaved, machine_line, noise_jpeg, result_line, spread, table
from httpcore._async import connection_pool
from PIL import Image, ImageChops

from modalgate.errors import ErrorCode
from modalgate.media.addresses import is_forbidden_address, parse_host_address
from modalgate.media.fetch import FetchError, MediaFetcher
from modalgate.media.urls import url_refusal
from modalgate.policy.models import MediaUrls

NAME = "m1_fetch_overhead"
TARGET = 1.25
MAX_BYTES = 32 * 1024 * 1024  # the default max_image_bytes
INFLIGHT = 8
FILES = {"photo.jpg": "image/jpeg", "icon.png": "image/png"}

# ---------------------------------------------------------------- the media


def make_jpeg() -> bytes:
    """720x720 random-noise JPEG at quality 92: ~0.5 MB (noise barely compresses)."""
    return noise_jpeg(side=720, quality=92)


def make_png(side: int = 128) -> bytes:
    """A 128x128 RGBA PNG (gradients, a little noise, a diagonal alpha ramp): ~22 KB."""
    gradient = Image.linear_gradient("L").resize((side, side))
    raw = random.Random(1).randbytes(side * side)
    noise = Image.frombytes("L", (side, side), bytes(x % 8 for x in raw))
    channels = [ImageChops.add(gradient.rotate(angle), noise) for angle in (0, 90, 180)]
    image = Image.merge("RGBA", (*channels, gradient.rotate(45)))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------- the server (--serve DIR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True
    responses: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:
        response = self.responses.get(self.path)
        if response is None:
            self.send_error(404)
            return
        self.wfile.write(response)  # status line, headers and body in one write

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(directory: str, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    for name, content_type in FILES.items():
        body = (Path(directory) / name).read_bytes()
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("ascii")
        _Handler.responses[f"/{name}"] = head + body
    ThreadingHTTPServer.request_queue_size = 64
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    # The parent holds our stdin: when it goes away, for whatever reason, so do we.
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


def start_server(directory: str, cpu: int | None) -> tuple[subprocess.Popen[str], int]:
    pin = [] if cpu is None else ["--server-cpu", str(cpu)]
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", directory, *pin],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"the media server did not start: {line!r}")
    return process, int(line.split()[1])


# ---------------------------------------------------------------- the clients


@dataclass
class Clients:
    fetcher: MediaFetcher
    plain: httpx.AsyncClient

    async def via_fetcher(self, url: str) -> int:
        fetched = await self.fetcher.fetch(url, max_bytes=MAX_BYTES, modality="image")
        return len(fetched.data)

    async def via_httpx(self, url: str) -> int:
        response = await self.plain.get(url)
        return len(response.content)


RULES = MediaUrls(schemes=("http",), allow_private=(ipaddress.ip_network("127.0.0.1/32"),))


async def open_clients() -> Clients:
    return Clients(MediaFetcher(RULES), httpx.AsyncClient(trust_env=False))


async def batch(get: Callable[[str], Awaitable[int]], url: str, n: int, inflight: int) -> None:
    """``n`` fetches of ``url``: one after another, or spread over ``inflight`` tasks."""
    if inflight == 1:
        for _ in range(n):
            await get(url)
        return

    async def worker(count: int) -> None:
        for _ in range(count):
            await get(url)

    await asyncio.gather(*(worker(n // inflight) for _ in range(inflight)))


async def check(clients: Clients, urls: dict[str, str], media: dict[str, bytes]) -> None:
    """Both clients return the served bytes; the fetcher's address check is in the path."""
    for name, url in urls.items():
        fetched = await clients.fetcher.fetch(url, max_bytes=MAX_BYTES, modality="image")
        assert fetched.data == media[name], name
        assert fetched.content_type == FILES[name], fetched.content_type
        response = await clients.plain.get(url)
        assert response.status_code == 200 and response.content == media[name], name
    strict = MediaFetcher(MediaUrls(schemes=("http",)))  # no allow_private: loopback refused
    try:
        await strict.fetch(urls["photo.jpg"], max_bytes=MAX_BYTES)
    except FetchError as exc:
        assert exc.code is ErrorCode.URL_NOT_ALLOWED, exc.code
    else:
        raise AssertionError("a fetcher without allow_private fetched from 127.0.0.1")
    finally:
        await strict.aclose()


# ---------------------------------------------------------------- breakdown and profile


def checks_breakdown(url: str, n: int = 2000) -> list[tuple[str, float]]:
    """Microseconds per call of the checks the fetcher makes before it connects."""
    parsed = httpx.URL(url)
    host = parsed.raw_host.decode("ascii")

    def per_call(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    def address_check() -> object:
        address = parse_host_address(host)
        assert address is not None
        return is_forbidden_address(address, RULES.allow_private)

    return [
        ("url_refusal(url, rules)", per_call(lambda: url_refusal(url, RULES))),
        ("httpx.URL(url)", per_call(lambda: httpx.URL(url))),
        ("parse_host_address + is_forbidden_address", per_call(address_check)),
    ]


def profile_diff(
    loop: asyncio.AbstractEventLoop, clients: Clients, url: str, variant: Variant, calls: int
) -> None:
    """cProfile both clients on one variant; print the functions where the fetcher spends more.

    Also counts httpcore's pool retries: a queued request handed a connection that
    another request took first raises ``ConnectionNotAvailable`` inside the pool,
    which clears the assignment and scans the pool again.
    """
    pool_request = getattr(connection_pool, "AsyncPoolRequest", None)
    original = getattr(pool_request, "clear_connection", None)
    retries = {"n": 0}

    def counting(self: object) -> None:
        retries["n"] += 1
        original(self)  # type: ignore[misc]

    n = variant.fetches * calls
    per_fetch: dict[str, dict[tuple, tuple[float, float]]] = {}
    retry_rate: dict[str, float] = {}
    if original is not None:
        pool_request.clear_connection = counting  # type: ignore[union-attr]
    try:
        for label, get in (("fetcher", clients.via_fetcher), ("httpx", clients.via_httpx)):
            retries["n"] = 0
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                loop.run_until_complete(batch(get, url, variant.fetches, variant.inflight))
            profiler.disable()
            retry_rate[label] = retries["n"] / n
            stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
            per_fetch[label] = {k: (v[1] / n, v[2] / n * 1e6) for k, v in stats.items()}
    finally:
        if original is not None:
            pool_request.clear_connection = original  # type: ignore[union-attr]

    fetcher, plain = per_fetch["fetcher"], per_fetch["httpx"]
    zero = (0.0, 0.0)
    extra = sorted(
        fetcher.keys() | plain.keys(),
        key=lambda k: plain.get(k, zero)[1] - fetcher.get(k, zero)[1],
    )
    rows = [
        (
            _where(k),
            fetcher.get(k, zero)[1] - plain.get(k, zero)[1],
            fetcher.get(k, zero)[0],
            plain.get(k, zero)[0],
        )
        for k in extra[:12]
    ]
    total = sum(t for _, t in fetcher.values()) - sum(t for _, t in plain.values())
    print(
        f"\ncProfile, {variant.name}: own time the fetcher spends beyond plain httpx, "
        f"µs per fetch under the profiler (total {total:+.0f}), and calls per fetch"
    )
    print(table(("function", "extra µs", "calls fetcher", "calls httpx"), rows))
    if original is not None:
        print(
            "httpcore pool retries (ConnectionNotAvailable) per fetch: "
            f"fetcher {retry_rate['fetcher']:.2f}, plain httpx {retry_rate['httpx']:.2f}"
        )


def _where(key: tuple) -> str:
    filename, line, function = key
    for marker in ("site-packages/", "modalgate/", "lib/python3."):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{line}({function})"[:72]


# ---------------------------------------------------------------- the benchmark


@dataclass
class Variant:
    name: str
    file: str
    inflight: int
    fetches: int  # per timed call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None, help="batches of each per round")
    parser.add_argument("--profile", action="store_true", help="cProfile both clients")
    parser.add_argument("--no-pin", action="store_true", help="leave both processes unpinned")
    parser.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--server-cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.server_cpu)
        return
    pin = not args.no_pin and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
    if pin:
        client_cpu, server_cpu = sorted(os.sched_getaffinity(0))[:2]
        os.sched_setaffinity(0, {client_cpu})
    rounds = args.rounds or (3 if args.quick else 15)
    reps = args.reps or (1 if args.quick else 3)

    media = {"photo.jpg": make_jpeg(), "icon.png": make_png()}
    variants = [
        Variant("JPEG, sequential", "photo.jpg", 1, 16),
        Variant(f"JPEG, {INFLIGHT} in flight", "photo.jpg", INFLIGHT, 64),
        Variant("PNG, sequential", "icon.png", 1, 48),
        Variant(f"PNG, {INFLIGHT} in flight", "icon.png", INFLIGHT, 192),
    ]

    with tempfile.TemporaryDirectory(prefix="modalgate-p4-") as directory:
        for name, data in media.items():
            (Path(directory) / name).write_bytes(data)
        server, port = start_server(directory, server_cpu if pin else None)
        loop = asyncio.new_event_loop()
        try:
            clients = loop.run_until_complete(open_clients())
            urls = {name: f"http://127.0.0.1:{port}/{name}" for name in media}
            loop.run_until_complete(check(clients, urls, media))
            print(f"== {NAME}")
            print(machine_line())
            print(
                f"server: stdlib ThreadingHTTPServer in a separate process, 127.0.0.1:{port}, "
                "HTTP/1.1 keep-alive; "
                + (
                    f"server pinned to CPU {server_cpu}, client to CPU {client_cpu}"
                    if pin
                    else "not pinned"
                )
            )
            jpeg, png = media["photo.jpg"], media["icon.png"]
            print(
                f"media: JPEG 720x720 q92 noise {len(jpeg) / 1e3:.0f} KB, "
                f"PNG 128x128 RGBA {len(png) / 1e3:.1f} KB"
            )
            print(
                "fetcher: MediaFetcher(MediaUrls(schemes=('http',), allow_private=(127.0.0.1/32,)))"
                ".fetch(url, max_bytes=32 MiB); plain: httpx.AsyncClient(trust_env=False).get(url)"
            )
            print(f"{rounds} rounds x {reps} reps per variant, interleaved; asyncio event loop")
            results = measure(loop, clients, urls, variants, rounds, reps)
            worst = max(r.ratio for r in results.values())
            passed = worst <= TARGET

            print("\nthe fetcher's checks before connecting, in-process (µs per call):")
            print(table(("check", "µs"), checks_breakdown(urls["photo.jpg"])))
            for variant in variants:
                if args.profile or results[variant.name].ratio > TARGET:
                    url = urls[variant.file]
                    profile_diff(loop, clients, url, variant, 1 if args.quick else 4)
            loop.run_until_complete(clients.fetcher.aclose())
            loop.run_until_complete(clients.plain.aclose())
        finally:
            loop.close()
            server.terminate()
            server.wait()
    print(result_line(NAME, worst, f"<={TARGET:g}", passed))


def measure(
    loop: asyncio.AbstractEventLoop,
    clients: Clients,
    urls: dict[str, str],
    variants: list[Variant],
    rounds: int,
    reps: int,
) -> dict[str, Rounds]:
    results: dict[str, Rounds] = {}
    rows = []
    gets = {"fetcher": clients.via_fetcher, "httpx": clients.via_httpx}
    start = time.perf_counter()
    for variant in variants:
        url = urls[variant.file]
        cpu: dict[str, list[float]] = {"fetcher": [], "httpx": []}

        def run(who: str, v: Variant = variant, u: str = url, cpu: dict = cpu) -> None:
            before = time.process_time()
            loop.run_until_complete(batch(gets[who], u, v.fetches, v.inflight))
            cpu[who].append((time.process_time() - before) / v.fetches)

        for _ in range(2):  # warm-up: opens every connection both pools will use
            run("fetcher")
            run("httpx")
        result = interleaved(
            lambda: run("fetcher"),
            lambda: run("httpx"),
            rounds=rounds,
            reps=reps,
            ratio=lambda fetcher, plain: fetcher / plain,
        )
        results[variant.name] = result
        cpu_a, cpu_b = (statistics.median(cpu[who][2:]) * 1e6 for who in ("fetcher", "httpx"))
        per_fetch_a = statistics.median(result.a) / variant.fetches * 1e6
        per_fetch_b = statistics.median(result.b) / variant.fetches * 1e6
        rows.append(
            (
                variant.name,
                variant.fetches,
                per_fetch_a,
                per_fetch_b,
                per_fetch_a - per_fetch_b,
                result.ratio,
                spread(result.ratios),
                cpu_a,
                cpu_b,
                cpu_a / cpu_b,
            )
        )
    elapsed = time.perf_counter() - start
    headers = (
        "variant",
        "fetches/call",
        "fetcher µs",
        "httpx µs",
        "diff µs",
        "ratio",
        "spread",
        "CPU fetcher",
        "CPU httpx",
        "CPU ratio",
    )
    print(table(headers, rows))
    print(
        "µs: wall time per fetch (batch time / fetches, medians over rounds; with 8 in flight "
        "the batch's wall time / fetches). CPU: the client process's CPU µs per fetch "
        f"(median over calls), not part of the ratio. {elapsed:.1f} s"
    )
    return results


if __name__ == "__main__":
    main()
