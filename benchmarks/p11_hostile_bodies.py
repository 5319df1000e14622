"""P11: the gate's CPU on the costliest body shapes under the inline limit, against benign ones.

Bodies below serve's thread threshold (256 KiB) are judged on the event loop, so
their cost must follow their size, whatever their shape: a body shaped to make the
gate do work per part, per part type tried or per value stalls every other request
on the loop while it is judged (red team round three, defects 7 and 8). This builds
~244 KiB bodies of each hostile shape found so far and benign ones of the same size,
and times ``validate_body`` on each under the vLLM dialect (where a typeless part is
read against the union of part types), interleaved, best of a few calls per round.

Ratio = the costliest hostile body's ms / the costliest benign body's ms (median over
rounds). Target: <= 100, set here (the issue asks for the ratio, not a bound): the
walk costs ~1.2-1.5 us a value (a part, a message) in Python, so a body of ten
thousand tiny parts costs ~70x one of a few long values, ~85 ns a byte at worst;
before the fix it was ~940 ns a byte (230 ms a body; the issue's figures). What the
ratio does not show is what the fix is for, so two more lines are printed: a small
text chat's latency while three of the costliest hostile bodies are judged beside it
(bodies of many values go to the gate's threads, the loop stays free) against three
benign ones; with ``--memory``, the peak RSS growth, in a fresh process each, of
judging a 30 MB body of ten million empty objects (refused before parsing: it was
~25x the body) and a 30 MB text body, as multiples of the body's size (<= 4x).

Usage: .venv/bin/python benchmarks/p11_hostile_bodies.py [--quick] [--memory]
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from _common import begin, data_url, result_line, spread, table, time_call
from PIL import Image

from modalgate.gateway.gate.middleware import ModalGate
from modalgate.policy import RuleMatcher, load_policy
from modalgate.settings import EngineSpec
from modalgate.validators import validate_body
from modalgate.validators.dialects import dialect_for

NAME = "p11_hostile_bodies"
TARGET = 100.0
SIZE = 244 * 1024
MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def chat_body(parts: list[object], **extra: object) -> bytes:
    request = {"model": MODEL, "messages": [{"role": "user", "content": parts}], **extra}
    return json.dumps(request, separators=(",", ":")).encode()


def filled(make: Callable[[int], bytes]) -> bytes:
    """``make(n)`` for the largest ``n`` whose body stays under SIZE (doubling, then bisecting)."""
    low, high = 1, 2
    while len(make(high)) <= SIZE:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(make(middle)) <= SIZE else (low, middle)
    return make(low)


def tiny_png(seed: int) -> str:
    image = Image.new("RGB", (32, 32), (seed % 256, 80, 160))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return data_url(buffer.getvalue(), "image/png")


def noise_jpeg_of(size: int) -> str:
    side = int((size * 0.75 / 0.5) ** 0.5)  # noise at q60: ~0.5 bytes a pixel
    image = Image.frombytes("RGB", (side, side), random.Random(1).randbytes(side * side * 3))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=60)
    return data_url(buffer.getvalue(), "image/jpeg")


def hostile() -> dict[str, bytes]:
    png = tiny_png(0)
    return {
        'typeless {"image_url": ""} parts': filled(lambda n: chat_body([{"image_url": ""}] * n)),
        'typeless {"text": "a"} parts': filled(lambda n: chat_body([{"text": "a"}] * n)),
        "empty {} parts": filled(lambda n: chat_body([{}] * n)),
        "typed empty text parts": filled(lambda n: chat_body([{"type": "text", "text": ""}] * n)),
        "parts of an unknown type": filled(lambda n: chat_body([{"type": "x"}] * n)),
        "one-part messages": filled(
            lambda n: json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * n},
                separators=(",", ":"),
            ).encode()
        ),
        "metadata of empty objects": filled(lambda n: chat_body(["hi"], metadata={"a": [{}] * n})),
        "32x32 PNGs (same)": filled(
            lambda n: chat_body([{"type": "image_url", "image_url": {"url": png}}] * n)
        ),
        "nested arrays, 100k deep": nested(100_000),
    }


def nested(depth: int) -> bytes:
    head = chat_body(["hi"], metadata={"a": 0})
    return head.replace(b'"a":0', b'"a":' + b"[" * depth + b"]" * depth)


def benign() -> dict[str, bytes]:
    prose = "The survey found the north wall sound, the roof in need of repair. "
    jpeg = noise_jpeg_of(SIZE - 2048)
    return {
        "one long text part": filled(lambda n: chat_body([{"type": "text", "text": prose * n}])),
        "a chat of 40 turns": filled(
            lambda n: json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "user" if i % 2 == 0 else "assistant", "content": prose * n}
                        for i in range(40)
                    ],
                },
                separators=(",", ":"),
            ).encode()
        ),
        "text and one JPEG": chat_body(
            [
                {"type": "text", "text": "What is in this photo?"},
                {"type": "image_url", "image_url": {"url": jpeg}},
            ]
        ),
    }


async def _answer(scope: dict, receive: Callable, send: Callable) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _post(gate: ModalGate, raw: bytes) -> tuple[int, float]:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    start = time.perf_counter()
    await gate(scope, receive, send)
    return sent[0]["status"], time.perf_counter() - start


async def _stall(gate: ModalGate, crowd: list[bytes], small: bytes) -> float:
    """How long a small text chat takes while ``crowd`` is judged beside it."""
    others = [asyncio.ensure_future(_post(gate, raw)) for raw in crowd]
    await asyncio.sleep(0.002)  # the crowd is being judged, on the loop or in threads
    status, took = await _post(gate, small)
    assert status == 200
    await asyncio.gather(*others)
    return took


def loop_stalls(hostile_body: bytes, benign_body: bytes, rounds: int) -> tuple[float, float]:
    """The small request's median latency beside three hostile, then three benign, bodies."""
    vllm = dialect_for(EngineSpec(name="vllm"))
    gate = ModalGate(_answer, dialect=vllm)
    small = chat_body([{"type": "text", "text": "hello"}])
    beside_hostile, beside_benign = [], []

    async def run() -> None:
        for _ in range(rounds):
            beside_hostile.append(await _stall(gate, [hostile_body] * 3, small))
            beside_benign.append(await _stall(gate, [benign_body] * 3, small))

    asyncio.run(run())
    return statistics.median(beside_hostile), statistics.median(beside_benign)


def thirty_mb_body(kind: str) -> bytes:
    if kind == "empty objects":
        head = b'{"model":"kimi-k3","messages":[{"role":"user","content":"hi"}],"metadata":{"a":['
        return head + b",".join([b"{}"] * 10_000_000) + b"]}}"
    text = "lorem ipsum dolor sit amet " * 1_150_000
    return json.dumps(
        {"model": "kimi-k3", "messages": [{"role": "user", "content": text}]}
    ).encode()


_RSS_SCRIPT = """
import sys
from pathlib import Path
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import validate_body
matcher = RuleMatcher(load_policy(), None)
validate_body(b'{"model":"kimi-k3","messages":[{"role":"user","content":"hi"}]}', matcher)
body = Path(sys.argv[1]).read_bytes()
def kib(field):
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith(field))
Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
before = kib("VmRSS:")
verdict = validate_body(body, matcher)
print((kib("VmHWM:") - before) * 1024 / len(body), verdict.accepted)
"""


def peak_rss_multiple(kind: str) -> tuple[float, bool]:
    """Peak RSS growth of judging one 30 MB body of ``kind`` in a fresh process, per body byte."""
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        file.write(thirty_mb_body(kind))
        file.flush()
        command = [sys.executable, "-c", _RSS_SCRIPT, file.name]
        output = subprocess.run(command, capture_output=True, text=True, check=True)
    multiple, accepted = output.stdout.split()
    return float(multiple), accepted == "True"


def main() -> None:
    args = begin(NAME, __doc__, memory="also the 30 MB peak-RSS check")
    matcher = RuleMatcher(load_policy(), None)
    vllm = dialect_for(EngineSpec(name="vllm"))
    bodies = {**{("hostile", k): v for k, v in hostile().items()},
              **{("benign", k): v for k, v in benign().items()}}  # fmt: skip
    verdicts = {
        key: validate_body(raw, matcher, dialect=lambda _rule: vllm) for key, raw in bodies.items()
    }
    rounds, reps = (3, 2) if args.quick else (9, 3)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in bodies}
    ratios: list[float] = []
    for r in range(rounds):
        keys = list(bodies) if r % 2 == 0 else list(reversed(bodies))
        for key in keys:
            raw = bodies[key]
            times[key].append(
                min(time_call(lambda raw=raw: validate_body(raw, matcher, dialect=lambda _r: vllm))
                    for _ in range(reps))
            )  # fmt: skip
        worst_hostile = max(times[k][-1] for k in bodies if k[0] == "hostile")
        worst_benign = max(times[k][-1] for k in bodies if k[0] == "benign")
        ratios.append(worst_hostile / worst_benign)
    rows = []
    for (side, label), raw in bodies.items():
        verdict = verdicts[(side, label)]
        outcome = (
            "accepted" if verdict.accepted else f"{verdict.status} {verdict.violations[0].code}"
        )
        median = statistics.median(times[(side, label)])
        rows.append((side, label, len(raw) // 1024, outcome, median * 1e3, median * 1e9 / len(raw)))
    print(table(("kind", "body", "KiB", "verdict", "ms", "ns/byte"), rows))
    ratio = statistics.median(ratios)
    print(f"costliest hostile / costliest benign: {ratio:.2f} (spread {spread(ratios)})")
    worst = max((k for k in bodies if k[0] == "hostile"), key=lambda k: statistics.median(times[k]))
    chat = ("benign", "a chat of 40 turns")
    hostile_ms, benign_ms = loop_stalls(bodies[worst], bodies[chat], rounds)
    print(
        f"a small text chat beside three '{worst[1]}' bodies: {hostile_ms * 1e3:.2f} ms;"
        f" beside three '{chat[1]}' bodies: {benign_ms * 1e3:.2f} ms"
        f" (ModalGate in process, vLLM dialect, median of {rounds})"
    )
    if args.memory:
        for kind in ("empty objects", "prose"):
            multiple, accepted = peak_rss_multiple(kind)
            verdict = "accepted" if accepted else "refused"
            print(f"30 MB body of {kind}: peak RSS growth {multiple:.2f}x the body ({verdict})")
    print(result_line(NAME, ratio, f"<={TARGET:g}", ratio <= TARGET))


if __name__ == "__main__":
    main()
