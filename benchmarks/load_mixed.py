"""Mixed load through a real ``modalgate serve --upstream``: every request answered, no 5xx,
no memory growth.

The stack is three processes on 127.0.0.1: the tests' toy OpenAI server
(``tests/toy_upstream.py``, SSE included), ``modalgate serve --mode encoder
--upstream`` in front of it, and this script's aiohttp client at
``--concurrency`` connections. The mix is what a gateway in front of Kimi-K3's
encoder sees: text chats, chats with one to three real images as data URLs,
Responses API bodies, streamed chats read to ``[DONE]``, and requests the gate
refuses (video and audio for an image-only model, corrupt images, bad JSON,
too many images).

Criteria (exit 1 if one fails): answered == sent; no 5xx; the gateway's
resident memory grows by less than ``--max-rss-growth-mb`` (50) from the end
of the warm-up to the end of the run; no traceback in the gateway's log.
Reported besides: p50/p99 latency overall and per class, requests per second,
and answers of the wrong kind per class (a refusal that was accepted, say).

    python benchmarks/load_mixed.py                     # 20,000 at concurrency 64
    python benchmarks/load_mixed.py --requests 2000 --report load.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the corpora

from corpora.fuzz_long import ServeStack, scan_gateway_log
from corpora.hostile import MP4_BYTES, WAV_BYTES  # the shared media

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MODEL = "kimi-k3"
# class -> weight in the mix
MIX = {
    "text": 25,
    "image": 25,
    "stream": 20,
    "responses": 10,
    "refusal": 20,
}


def _jpeg(side: int, seed: int) -> bytes:
    noise = random.Random(seed).randbytes(side * side * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (side, side), noise).save(buffer, "JPEG", quality=85)
    return buffer.getvalue()


def _png(size: tuple[int, int], color: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass(frozen=True)
class Planned:
    """One request of the mix, and what a correct gateway answers to it."""

    kind: str
    path: str
    body: bytes
    stream: bool
    expect: int  # the status a correct gateway gives


class Mix:
    """The request bodies, built once (images are Pillow-made, some of them noise)."""

    def __init__(self) -> None:
        self.images = [
            _data_url(_png((64, 48), "red"), "image/png"),
            _data_url(_png((320, 240), "blue"), "image/png"),
            _data_url(_jpeg(128, 1), "image/jpeg"),
            _data_url(_jpeg(256, 2), "image/jpeg"),  # ~50 KB: a photo-like small image
        ]
        corrupt = bytearray(base64.b64decode(self.images[2].split(",", 1)[1]))
        corrupt = corrupt[: len(corrupt) // 3]  # a truncated JPEG
        self.refusals: list[tuple[str, bytes]] = [
            ("video", self._chat([{"type": "video_url", "video_url": {"url": _mp4()}}])),
            (
                "audio",
                self._chat(
                    [
                        {
                            "type": "input_audio",
                            "input_audio": {
                                "data": base64.b64encode(WAV_BYTES).decode(),
                                "format": "wav",
                            },
                        }
                    ]
                ),
            ),
            (
                "truncated_jpeg",
                self._chat(
                    [{"type": "image_url", "image_url": {"url": _data_url(corrupt, "image/jpeg")}}]
                ),
            ),
            ("bad_json", b'{"model": "kimi-k3", "messages": [}'),
            (
                "too_many_images",
                self._chat(
                    [{"type": "image_url", "image_url": {"url": self.images[0]}} for _ in range(17)]
                ),
            ),
            (
                "video_in_image_url",
                self._chat([{"type": "image_url", "image_url": {"url": _mp4()}}]),
            ),
        ]

    @staticmethod
    def _chat(parts: list[Any], stream: bool = False, **extra: Any) -> bytes:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Describe."}, *parts]},
            ],
            "max_tokens": 16,
            **extra,
        }
        if stream:
            body["stream"] = True
        return orjson.dumps(body)

    def plan(self, rng: random.Random) -> Planned:
        kind = rng.choices(list(MIX), list(MIX.values()))[0]
        if kind == "text":
            return Planned(kind, CHAT, self._chat([]), False, 200)
        if kind == "image":
            chosen = rng.sample(self.images, rng.randint(1, 3))
            parts = [{"type": "image_url", "image_url": {"url": url}} for url in chosen]
            return Planned(kind, CHAT, self._chat(parts), False, 200)
        if kind == "stream":
            parts = (
                [{"type": "image_url", "image_url": {"url": rng.choice(self.images)}}]
                if rng.random() < 0.5
                else []
            )
            return Planned(kind, CHAT, self._chat(parts, stream=True), True, 200)
        if kind == "responses":
            content: list[Any] = [{"type": "input_text", "text": "Describe."}]
            if rng.random() < 0.6:
                content.append({"type": "input_image", "image_url": rng.choice(self.images)})
            body = {"model": MODEL, "input": [{"role": "user", "content": content}]}
            return Planned(kind, RESPONSES, orjson.dumps(body), False, 200)
        _, body = rng.choice(self.refusals)
        return Planned(kind, CHAT, body, False, 400)


def _mp4() -> str:
    return _data_url(MP4_BYTES, "video/mp4")


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc (psutil when it is installed)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        pass
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@dataclass
class Results:
    sent: int = 0
    answered: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)


async def one(
    session: aiohttp.ClientSession, base: str, planned: Planned, results: Results, timeout_s: float
) -> None:
    """Send one request; answered means a status and the whole body (SSE: to ``[DONE]``)."""
    results.sent += 1
    started = time.perf_counter()
    try:
        async with session.post(
            base + planned.path,
            data=planned.body,
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            body = await response.read()
            status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        results.errors[f"{planned.kind}: {type(exc).__name__}"] += 1
        results.examples.setdefault(f"error {type(exc).__name__}", str(exc)[:300])
        return
    elapsed = time.perf_counter() - started
    complete = True
    if planned.stream and status == 200:
        complete = body.rstrip().endswith(b"data: [DONE]")
        if not complete:
            results.errors[f"{planned.kind}: stream without [DONE]"] += 1
            results.examples.setdefault("stream without [DONE]", body[-300:].decode("replace"))
            return
    results.answered += 1
    results.statuses[f"{status}"] += 1
    results.latencies[planned.kind].append(elapsed)
    if status != planned.expect:
        results.unexpected[f"{planned.kind}: {status}"] += 1
        results.examples.setdefault(f"{planned.kind} {status}", body[:300].decode("replace"))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(
    base: str,
    plans: list[Planned],
    concurrency: int,
    timeout_s: float,
    results: Results,
    every: Callable[[int], None] | None = None,
) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        queue = iter(enumerate(plans))

        async def worker() -> None:
            for index, planned in queue:
                await one(session, base, planned, results, timeout_s)
                if every is not None:
                    every(index)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the RSS base")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    parser.add_argument("--mode", default="encoder")
    parser.add_argument("--report", type=Path)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    mix = Mix()
    warmup = [mix.plan(rng) for _ in range(min(args.warmup, args.requests))]
    plans = [mix.plan(rng) for _ in range(args.requests)]
    upstream = [sys.executable, str(ROOT / "tests" / "toy_upstream.py"), "--name", "toy"]
    stack = ServeStack(
        args.mode or None,
        upstream_command=upstream,
        upstream_ready_path="/health",
    )
    with stack:
        base = f"http://127.0.0.1:{stack.port}"
        toy = f"http://127.0.0.1:{stack.upstream_port}"
        pid = stack.gateway.pid

        def forget(index: int) -> None:
            """The toy upstream keeps every body it receives: let it forget now and then."""
            if index % 2000 == 1999:
                asyncio.get_running_loop().run_in_executor(
                    None, lambda: httpx.delete(toy + "/_received", timeout=10)
                )

        warm = Results()
        asyncio.run(drive(base, warmup, args.concurrency, args.timeout, warm, forget))
        httpx.delete(toy + "/_received", timeout=10)
        rss_start = rss_mb(pid)
        samples = [rss_start]

        def watch(index: int) -> None:
            forget(index)
            if index % 1000 == 0:
                samples.append(rss_mb(pid))

        results = Results()
        started = time.perf_counter()
        asyncio.run(drive(base, plans, args.concurrency, args.timeout, results, watch))
        wall = time.perf_counter() - started
        time.sleep(1.0)  # let buffers settle: what stays is what leaked
        rss_end = rss_mb(pid)
        samples.append(rss_end)
        time.sleep(0.3)
        logged = scan_gateway_log(stack.log_text())
        gateway_alive = stack.gateway.poll() is None

    every = [v for values in results.latencies.values() for v in values]
    fivexx = sum(n for status, n in results.statuses.items() if status.startswith("5"))
    report: dict[str, Any] = {
        "sent": results.sent,
        "answered": results.answered,
        "not_answered": dict(results.errors),
        "by_status": dict(results.statuses.most_common()),
        "5xx": fivexx,
        "unexpected_answers": dict(results.unexpected),
        "rss_mb": {
            "after_warmup": round(rss_start, 1),
            "end": round(rss_end, 1),
            "growth": round(rss_end - rss_start, 1),
            "max": round(max(samples), 1),
        },
        "latency_ms": {
            "all": _latency(every),
            **{kind: _latency(values) for kind, values in sorted(results.latencies.items())},
        },
        "wall_s": round(wall, 2),
        "requests_per_s": round(results.sent / wall, 1),
        "gateway_log_errors": len(logged),
        "gateway_alive": gateway_alive,
        "concurrency": args.concurrency,
        "examples": results.examples,
    }
    criteria = {
        "every request answered": results.answered == results.sent == args.requests,
        "no 5xx": fivexx == 0,
        f"RSS growth < {args.max_rss_growth_mb:g} MB": rss_end - rss_start < args.max_rss_growth_mb,
        "no traceback or error in the gateway log": not logged,
        "the gateway still runs": gateway_alive,
    }
    report["criteria"] = criteria
    if logged:
        report["gateway_log_first"] = [line for _, line in logged[:5]]
    print(json.dumps(report, indent=1))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1))
    failed = [name for name, ok in criteria.items() if not ok]
    print("FAILED: " + "; ".join(failed) if failed else "all criteria met", file=sys.stderr)
    return 1 if failed else 0


def _latency(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": round(percentile(values, 0.50) * 1000, 2),
        "p99": round(percentile(values, 0.99) * 1000, 2),
        "mean": round(statistics.fmean(values) * 1000, 2) if values else float("nan"),
    }


if __name__ == "__main__":
    sys.exit(main())
