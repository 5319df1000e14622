"""Which engine serves a rule, and so in which dialect the gate reads its requests.

The rule's own ``engine`` (policy) wins; validation reads it there. Otherwise the
route the rule takes decides: the default upstream's ``--engine`` and vLLM flags,
else what the route's upstreams said of themselves in ``/v1/models`` (vLLM and
SGLang answer ``owned_by: "vllm"`` / ``"sglang"``), else an OpenAI-compatible
server of unknown make (``openai``). A route whose upstreams are not all the same
engine as far as the gate knows (a vLLM and an SGLang, or one it has not read yet)
is read as ``openai``: the strictest reading, valid for whichever server the
balancer picks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from modalgate.gateway.upstream.balancer import UpstreamRoute, Upstreams
from modalgate.policy.matching import ResolvedRule
from modalgate.settings import Engine, EngineSpec, GatewaySettings
from modalgate.validators.dialects import Dialect, dialect_for

logger = logging.getLogger("modalgate.routes")

# What an engine writes in its model objects' ``owned_by``.
OWNED_BY: dict[str, Engine] = {"vllm": "vllm", "sglang": "sglang"}


def engine_of(models: Iterable[dict[str, Any]]) -> Engine | None:
    """The engine a ``/v1/models`` list names, when its models agree on one."""
    named = {OWNED_BY.get(str(m.get("owned_by", "")).casefold()) for m in models}
    named.discard(None)
    return named.pop() if len(named) == 1 else None


class EngineDialects:
    """``DialectOf`` for the gateway: the dialect of the server a rule's requests reach."""

    def __init__(self, upstreams: Upstreams, settings: GatewaySettings) -> None:
        self.upstreams = upstreams
        self.settings = settings
        self._default_flags = {
            "enable_mm_embeds": settings.enable_mm_embeds,
            "enable_prompt_embeds": settings.enable_prompt_embeds,
            "trust_request_mm_kwargs": settings.trust_request_mm_kwargs,
        }

        self._mixed_logged: set[tuple[str, frozenset[str]]] = set()

    def __call__(self, rule: ResolvedRule) -> Dialect:
        if rule.engine is not None:  # the policy's word (validation reads it there too)
            return dialect_for(rule.engine)
        route = self.upstreams.route_for(rule)
        default = route is None or route is self.upstreams.default
        name: Engine | None = self.settings.engine if default else None
        if name is None and route is not None:
            name = self._route_engine(route)
        if name is None:
            return dialect_for(None)
        # The vLLM flags are the default upstream's; a rule's own servers say theirs
        # in the rule's ``engine``.
        flags = self._default_flags if default and name == "vllm" else {}
        return dialect_for(EngineSpec(name=name, **flags))

    def _route_engine(self, route: UpstreamRoute) -> Engine | None:
        """The engine every target of ``route`` named; ``openai`` where they differ
        (a target not read yet counts as one of unknown make), logged once per mix."""
        if not route.targets:
            return None
        first = route.targets[0][0].engine
        if len(route.targets) == 1 or all(t.engine == first for t, _ in route.targets[1:]):
            return first
        mix = frozenset(t.engine or "unknown" for t, _ in route.targets)
        if (route.name, mix) not in self._mixed_logged:
            self._mixed_logged.add((route.name, mix))
            logger.warning(
                "route %s balances different engines: its requests are read as openai",
                route.name,
                extra={"fields": {"route": route.name, "engines": sorted(mix)}},
            )
        return "openai"
