"""The one decision every entry point takes: parse, validate, fall back, fetch, inline.

The middleware (and through it ``/v1/validate`` and ``/v1/encode``) and
``modalgate validate`` all call ``Decider.decide``, so a body gets the same
verdict wherever it arrives. Validation and rewrites are CPU work handed to
``run_cpu`` (inline for small bodies, a worker thread for big ones); fetching
remote media is the one I/O step, and an entry point may leave it out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from modalgate.errors import Violation
from modalgate.gateway.gate.remote_media import MediaStage
from modalgate.policy import RuleMatcher
from modalgate.validators import Verdict, validate_body, with_fallback
from modalgate.validators.json_body import Location, rewrite_json_body
from modalgate.validators.request import Api, ServedModel

T = TypeVar("T")
RunCpu = Callable[..., Awaitable[Any]]  # (size, function, *args) -> function(*args)


async def run_inline(size: int, function: Callable[..., T], *args: object) -> T:
    return function(*args)


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict, and the body to pass on: the client's own bytes unless a rewrite
    (a fallback's ``model``, inlined media) changed some values."""

    verdict: Verdict
    body: bytes  # the very object received when nothing was rewritten


@dataclass(frozen=True, slots=True)
class Decider:
    matcher: RuleMatcher
    media: MediaStage | None  # None: remote media are judged by their URL alone
    served: ServedModel | None = None
    run_cpu: RunCpu = run_inline

    async def decide(self, body: bytes, api: Api = "chat") -> Decision:
        received = len(body)
        verdict: Verdict = await self.run_cpu(
            received, validate_body, body, self.matcher, api, self.served
        )
        edits: list[tuple[Location, object]] = []
        if not verdict.accepted and verdict.rule is not None and verdict.rule.fallback:
            verdict = await self.run_cpu(received, with_fallback, verdict, self.matcher, received)
            if verdict.routed_from is not None and verdict.accepted:
                edits.append((("model",), verdict.model))
        if verdict.accepted and verdict.remote_parts and self.media is not None:
            verdict = await self.media.fetch(verdict)
            if verdict.accepted and self.media.inline:
                inlined = self.media.inlined(verdict)
                if isinstance(inlined, Violation):
                    verdict = verdict.with_violations(inlined)
                else:
                    edits += inlined
        if verdict.accepted and edits:
            # Only the edited values change; every other byte's meaning, numbers included,
            # goes on as the client sent it.
            grown = received + sum(p.inlined_size() for p in verdict.remote_parts)
            body = await self.run_cpu(grown, rewrite_json_body, body, edits)
        return Decision(verdict, body)
