"""Which engine serves a rule, and so in which dialect the gate reads its requests.

The rule's own ``engine`` (policy) wins; validation reads it there. Otherwise the
route the rule takes decides: the default upstream's ``--engine`` and vLLM flags,
else what the route's upstreams said of themselves in ``/v1/models`` (vLLM and
SGLang answer ``owned_by: "vllm"`` / ``"sglang"``), else an OpenAI-compatible
server of unknown make (``openai``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from modalgate.gateway.upstream.balancer import Upstreams
from modalgate.policy.matching import ResolvedRule
from modalgate.settings import Engine, EngineSpec, GatewaySettings
from modalgate.validators.dialects import Dialect, dialect_for

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

    def __call__(self, rule: ResolvedRule) -> Dialect:
        route = self.upstreams.route_for(rule)
        default = route is None or route is self.upstreams.default
        name: Engine | None = self.settings.engine if default else None
        if name is None and route is not None:
            name = next((t.engine for t, _ in route.targets if t.engine), None)
        if name is None:
            return dialect_for(None)
        # The vLLM flags are the default upstream's; a rule's own servers say theirs
        # in the rule's ``engine``.
        flags = self._default_flags if default and name == "vllm" else {}
        return dialect_for(EngineSpec(name=name, **flags))
