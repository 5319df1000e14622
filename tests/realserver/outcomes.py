"""Direct vs gated: each corpus body sent to the model server straight and through the gate.

Outcomes are classified as the issue defines them:

- protected: the server fails (5xx, dies, hangs) and the gate refuses it;
- bypass: the gate forwards it and the server fails;
- false reject: the server answers 200 and the gate refuses;
- both refuse: the server refuses with a 4xx of its own and so does the gate;
- both fine: the server answers 200 and so does the gated request.

A gate refusal is told apart from an upstream error it passed on by modalgate's own
envelope, which lists ``violations``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson

DIED, HUNG = "died", "hung"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int | str  # an HTTP status, DIED or HUNG
    code: str | None = None  # the gate's error code, where the gate refused
    param: str | None = None

    @property
    def fine(self) -> bool:
        return self.status == 200

    @property
    def failed(self) -> bool:
        return self.status in (DIED, HUNG) or (isinstance(self.status, int) and self.status >= 500)

    @property
    def gate_refused(self) -> bool:
        """The gate's own 4xx: its 5xx (upstream_unavailable, ...) say the server failed."""
        return self.code is not None and isinstance(self.status, int) and self.status < 500


def post(client: httpx.Client, url: str, body: dict[str, Any], alive: Callable[[], bool]) -> Reply:
    """One request; a dropped connection is DIED when the server is gone, else retried once."""
    for attempt in range(2):
        try:
            response = client.post(url, content=orjson.dumps(body), headers=_JSON)
        except httpx.TimeoutException:
            return Reply(HUNG)
        except httpx.TransportError:
            if not alive() or attempt:
                return Reply(DIED)
            continue
        return _reply(response)
    raise AssertionError("unreachable")


class Restartable(Protocol):
    url: str

    def alive(self) -> bool: ...
    def wait_down(self) -> None: ...
    def ensure_up(self) -> None: ...


def post_direct(client: httpx.Client, server: Restartable, body: dict[str, Any]) -> Reply:
    """One body straight at a server that may die of it: a death is only counted once a
    fresh server dies of the same body too (the one before may have been dying of the
    previous body as this one came)."""
    server.ensure_up()
    reply = post(client, server.url + CHAT, body, server.alive)
    if reply.status != DIED:
        return reply
    server.wait_down()
    server.ensure_up()
    reply = post(client, server.url + CHAT, body, server.alive)
    if reply.status == DIED:
        server.wait_down()
    return reply


def _reply(response: httpx.Response) -> Reply:
    if response.status_code == 200:
        return Reply(200)
    try:
        error = orjson.loads(response.content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict) and "violations" in error:
        return Reply(response.status_code, error.get("code"), error.get("param"))
    return Reply(response.status_code)


def classify(direct: Reply, gated: Reply) -> str:
    if gated.gate_refused:
        if direct.fine:
            return "false reject"
        return "protected" if direct.failed else "both refuse"
    if gated.failed:
        own = gated.code is not None and not gated.code.startswith("upstream_")
        return "gate 5xx" if own else "bypass"
    if direct.fine and gated.fine:
        return "both fine"
    if direct.failed and gated.fine:
        return "gated fine, direct failed"  # the gate mended it (an inlined fetch, say)
    return "both refuse" if not gated.fine else "differ"


@dataclass
class Table:
    rows: list[tuple[str, Reply, Reply, str]] = field(default_factory=list)

    def add(self, name: str, direct: Reply, gated: Reply) -> None:
        self.rows.append((name, direct, gated, classify(direct, gated)))

    def counts(self) -> Counter[str]:
        return Counter(kind for *_, kind in self.rows)

    def of(self, kind: str) -> list[tuple[str, Reply, Reply, str]]:
        return [row for row in self.rows if row[3] == kind]

    def render(self) -> str:
        lines = [f"{len(self.rows)} requests"]
        lines += [f"  {kind:28} {count}" for kind, count in sorted(self.counts().items())]
        direct = Counter(str(row[1].status) for row in self.rows)
        lines.append("direct outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(direct.items())))
        codes = Counter(row[2].code for row in self.rows if row[2].code)
        lines.append(
            "gate refusals by code: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))
        )
        for kind in ("bypass", "gate 5xx", "false reject", "differ"):
            for name, direct_reply, gated, _ in self.of(kind):
                shown = f"gated {gated.status} {gated.code or ''}".strip()
                lines.append(f"{kind}: {name}: direct {direct_reply.status}, {shown}")
        return "\n".join(lines)


_JSON = {"content-type": "application/json"}


def wait_healthy(
    url: str, timeout_s: float = 60.0, alive: Callable[[], bool] = lambda: True
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{url} exited before it was healthy")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")
