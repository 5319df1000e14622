"""``GET /v1/models``: the models served here, each with what it takes in the mode served.

The list merges what the upstreams report (their model objects are kept, fields
and all) with the policy: rules that name their own upstream are listed even
when their server is down, and a gateway without upstreams (a validation
service) lists every rule with a plain name. Each object gains
``input_modalities`` (OpenRouter's names: text, image, audio, video, file) and
``capabilities``, so a client can check a request before it sends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response

from modalgate.errors import ErrorCode, Violation, error_json
from modalgate.gateway.gate.send import json_bytes
from modalgate.gateway.upstream.balancer import Target, Upstreams
from modalgate.gateway.upstream.engines import engine_of
from modalgate.policy import RuleMatcher
from modalgate.policy.matching import ResolvedRule

MODALITY_ORDER = ("text", "image", "audio", "video", "file")
UPSTREAM_LIST_TTL_S = 10.0
MODEL_LIST_TIMEOUT_S = 2.0
_WILDCARDS = frozenset("*?[")


class ModelCatalog:
    def __init__(self, matcher: Callable[[], RuleMatcher], upstreams: Upstreams) -> None:
        self._matcher = matcher  # the gate's current one: a reload changes it
        self.upstreams = upstreams
        self._reported: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        upstreams.on_answering = self.relist  # a target back up, or never read: read it

    async def relist(self, target: Target) -> None:
        """Read ``target``'s model list now, whatever was cached."""
        self._reported.pop(target.url, None)
        await self._listed_by(target)

    @property
    def matcher(self) -> RuleMatcher:
        return self._matcher()

    async def models(self) -> list[dict[str, Any]]:
        listed: dict[str, dict[str, Any]] = {}
        for reported in await self._upstream_models():
            model_id = reported.get("id")
            if isinstance(model_id, str) and model_id not in listed:
                listed[model_id] = reported
        for name in self._policy_names():
            listed.setdefault(
                name, {"id": name, "object": "model", "created": 0, "owned_by": "modalgate"}
            )
        described = (self._described(model) for model in listed.values())
        return [model for model in described if model is not None]

    async def model(self, model_id: str) -> dict[str, Any] | None:
        for model in await self.models():
            if model["id"] == model_id:
                return model
        rule = self.matcher.resolve(model_id)
        if rule.known:  # a glob rule's model that no upstream listed
            return self._described(
                {"id": model_id, "object": "model", "created": 0, "owned_by": "modalgate"}
            )
        return None

    def _policy_names(self) -> list[str]:
        with_routes = self.upstreams.by_rule
        names = []
        for rule in self.matcher.rules:
            if _WILDCARDS & set(rule.name):
                continue
            if rule.name in with_routes or not self.upstreams.configured:
                names.append(rule.name)
        return names

    def _described(self, model: dict[str, Any]) -> dict[str, Any] | None:
        """The model with its capabilities; None for one this gateway would refuse."""
        rule = self.matcher.resolve(model["id"])
        if not rule.known and self.matcher.refuses_unknown:
            return None
        return {**model, **capabilities(rule, self.matcher.mode)}

    async def refresh(self) -> None:
        """Read every upstream's model list now (at start and after a reload), so the
        gate knows which model each one serves before the first request."""
        self._reported.clear()
        await self._upstream_models(all_targets=True)

    async def _upstream_models(self, all_targets: bool = False) -> list[dict[str, Any]]:
        targets = [t for t in self.upstreams.targets.values() if t.healthy or all_targets]
        found: list[list[dict[str, Any]]] = [[] for _ in targets]

        async def one(index: int, target: Target) -> None:
            found[index] = await self._listed_by(target)

        async with anyio.create_task_group() as group:
            for index, target in enumerate(targets):
                group.start_soon(one, index, target)
        return [model for models in found for model in models]

    async def _listed_by(self, target: Target) -> list[dict[str, Any]]:
        cached = self._reported.get(target.url)
        if cached is not None and time.monotonic() - cached[0] < UPSTREAM_LIST_TTL_S:
            return cached[1]
        try:
            response = await target.proxy.get("/v1/models", MODEL_LIST_TIMEOUT_S)
            data = response.json().get("data") if response.status_code == 200 else None
        except (httpx.HTTPError, TimeoutError, ValueError, AttributeError):
            data = None  # an upstream without a model list: the policy speaks for it
        models = learn_models(target, data) if isinstance(data, list) else []
        self._reported[target.url] = (time.monotonic(), models)
        return models

    async def list_endpoint(self, request: Request) -> Response:
        body = {"object": "list", "data": await self.models()}
        return Response(json_bytes(body), media_type="application/json")

    async def model_endpoint(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        model = await self.model(model_id)
        if model is None:
            violation = Violation(
                ErrorCode.UNKNOWN_MODEL, f"model: unknown model {model_id[:100]!r}", "model"
            )
            return Response(error_json([violation]), 404, media_type="application/json")
        return Response(json_bytes(model), media_type="application/json")


def learn_models(target: Target, data: list[Any]) -> list[dict[str, Any]]:
    """``target``'s ``/v1/models`` list (its ``data``) read: which models it serves and
    which engine it is, as the gate judges requests routed to it. The one place these
    are learnt: at start, on reload, on ``GET /v1/models``, on each readiness probe that
    got a list (health.py), and when the health watch finds the target answering again."""
    models = [m for m in data if isinstance(m, dict)]
    target.served = tuple(m["id"] for m in models if isinstance(m.get("id"), str))
    target.engine = engine_of(models)
    target.listed = True
    return models


def capabilities(rule: ResolvedRule, mode: str | None) -> dict[str, Any]:
    """What a client needs to build a request this model takes, in this mode."""
    modalities = [m for m in MODALITY_ORDER if m == "text" or m in rule.accepts]
    limits = rule.limits
    return {
        "input_modalities": modalities,
        "output_modalities": ["text"],
        "capabilities": {
            "mode": mode,
            "rule": rule.name if rule.known else None,
            "max_images": limits.max_images if "image" in rule.accepts else 0,
            "max_image_bytes": limits.max_image_bytes,
            "max_image_pixels": limits.max_image_pixels,
            "min_image_side": limits.min_image_side,
            "image_formats": list(limits.image_formats),
            "max_image_tokens": limits.max_image_tokens,
            "max_request_image_tokens": limits.max_request_image_tokens,
            "max_body_bytes": limits.max_body_bytes,
            "token_family": rule.tokens.family if rule.tokens else None,
            "media_roles": sorted(rule.media_roles),
            "fallback": dict(rule.fallback) or None,
        },
    }
