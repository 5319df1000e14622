"""Which server takes a request: per-model routes from the policy, the default upstream,
health checks, weighted choice and fail-over.

Every distinct upstream URL has one ``Target`` (one connection pool, one health
state) however many routes name it. A route picks among its healthy targets by
weight; a target that refuses a connection is marked down and the request, which
never left, goes to the next one. A background probe marks targets up again.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from modalgate.gateway.upstream.proxy import UpstreamObserver, UpstreamProxy, UpstreamSettings
from modalgate.policy.matching import ResolvedRule
from modalgate.policy.models import ModelRule, UpstreamTarget

logger = logging.getLogger("modalgate.routes")
DEFAULT_ROUTE = "default"
PROBE_TIMEOUT_S = 2.0


@dataclass(eq=False)
class Target:
    url: str
    proxy: UpstreamProxy
    healthy: bool = True
    checked_at: float = field(default=-1e9)
    served: tuple[str, ...] = ()  # model ids its /v1/models listed, when last read
    engine: str | None = None  # the engine its /v1/models named (owned_by), if one
    listed: bool = False  # ``served`` and ``engine`` come from a model list it answered

    def mark(self, healthy: bool) -> None:
        if healthy != self.healthy:
            logger.warning(
                "upstream %s", "back up" if healthy else "down", extra={"fields": {"url": self.url}}
            )
        self.healthy = healthy


@dataclass(frozen=True, eq=False)
class UpstreamRoute:
    name: str
    targets: tuple[tuple[Target, int], ...]  # (target, weight)

    def order(self) -> list[Target]:
        """Healthy targets first, drawn by weight; the down ones last, as a last resort."""
        if len(self.targets) == 1:
            return [self.targets[0][0]]
        healthy = [(t, w) for t, w in self.targets if t.healthy]
        ordered: list[Target] = []
        while healthy:
            (pick,) = random.choices(range(len(healthy)), [w for _, w in healthy])
            ordered.append(healthy.pop(pick)[0])
        return ordered + [t for t, _ in self.targets if not t.healthy]

    @property
    def up(self) -> bool:
        return any(target.healthy for target, _ in self.targets)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One exchange with a target picked by weight; the next one when it cannot be
        reached (the request never left), the last one answers whatever happens."""
        order = self.order()
        for index, target in enumerate(order):
            last = index == len(order) - 1
            if await target.proxy.exchange(
                scope, receive, send, route=self.name, fail_over=not last
            ):
                return
            target.mark(False)


class Upstreams:
    """The targets and routes of one policy; rebuilt on reload, pools kept by URL."""

    def __init__(
        self,
        default: str | None,
        settings: UpstreamSettings,
        health_path: str,
        on_upstream: UpstreamObserver | None = None,
        on_response_end: Callable[[float, str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.health_path = health_path
        self._on_upstream = on_upstream
        self._on_response_end = on_response_end
        self.targets: dict[str, Target] = {}
        self.default = (
            self._route(DEFAULT_ROUTE, [UpstreamTarget(url=default)]) if default else None
        )
        self.by_rule: dict[str, UpstreamRoute] = {}
        # Called by the health watch for a target that answers again, or answers and
        # never listed its models (down at start): the catalog reads its list then.
        self.on_answering: Callable[[Target], Awaitable[None]] | None = None

    def _target(self, url: str) -> Target:
        if url not in self.targets:
            proxy = UpstreamProxy(
                url,
                self.settings,
                on_upstream=self._on_upstream,
                on_response_end=self._on_response_end,
            )
            self.targets[url] = Target(url, proxy)
        return self.targets[url]

    def _route(self, name: str, targets: Iterable[UpstreamTarget]) -> UpstreamRoute:
        return UpstreamRoute(name, tuple((self._target(t.url), t.weight) for t in targets))

    def use_policy(self, rules: Iterable[ModelRule]) -> list[Target]:
        """Routes for the rules of the gateway's mode (``RuleMatcher.rules``); returns
        targets no route uses any more."""
        self.by_rule = {
            rule.name: self._route(rule.name, rule.upstream) for rule in rules if rule.upstream
        }
        used = {t.url for route in self.routes for t, _ in route.targets}
        retired = [t for url, t in self.targets.items() if url not in used]
        for target in retired:
            del self.targets[target.url]
        return retired

    @property
    def routes(self) -> list[UpstreamRoute]:
        return [*self.by_rule.values(), *([self.default] if self.default else [])]

    def route_for(self, rule: ResolvedRule | None) -> UpstreamRoute | None:
        if rule is not None and rule.known and rule.name in self.by_rule:
            return self.by_rule[rule.name]
        return self.default

    @property
    def configured(self) -> bool:
        return bool(self.targets)

    async def probe(self, max_age_s: float = 0.0) -> None:
        """Check every target whose state is older than ``max_age_s``, all at once."""
        now = time.monotonic()
        stale = [t for t in self.targets.values() if now - t.checked_at >= max_age_s]
        async with anyio.create_task_group() as group:
            for target in stale:
                group.start_soon(self._probe_one, target)

    async def _probe_one(self, target: Target) -> None:
        was_healthy = target.healthy
        try:
            response = await target.proxy.get(self.health_path, PROBE_TIMEOUT_S)
            healthy = response.status_code < 500
        except (httpx.HTTPError, TimeoutError):
            healthy = False
        target.checked_at = time.monotonic()
        target.mark(healthy)
        if healthy and (not was_healthy or not target.listed) and self.on_answering:
            await self.on_answering(target)

    async def watch(self, interval_s: float) -> None:
        while True:
            await self.probe()
            await anyio.sleep(interval_s)

    async def aclose(self) -> None:
        for target in list(self.targets.values()):
            await target.proxy.aclose()
