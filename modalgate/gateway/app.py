"""The standalone gateway behind ``modalgate serve``, and the app factory other servers import.

The stack, outermost first: RequestId (ids, access log) -> ModalGate (validate,
fetch) -> the router. The router answers the gateway's own paths (/healthz,
/readyz, /metrics, /v1/validate, /v1/encode) and hands every other request to
the upstream proxy, after the encoder-side rewrite for rules that ask for it.
Without an upstream, the chat paths answer with the verdict itself (a
validation service) and other paths are 404. With ``authz_prefix`` it answers
Envoy's ext_authz checks under that prefix instead (service/authz.py); built with
``extproc`` it decides for Envoy's ext_proc filter (service/extproc.py), and with
``check_prefix`` for its Lua filter (the same answer over HTTP).

``create_app()`` with no arguments reads ``MODALGATE_*`` variables, so any ASGI
server can serve it: ``uvicorn --factory modalgate.gateway.app:create_app``,
``hypercorn 'modalgate.gateway.app:create_app()'``,
``granian --interface asgi --factory modalgate.gateway.app:create_app``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from os import PathLike

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from modalgate.encoder_adapter import EncoderAdapter, create_encoder
from modalgate.errors import Violation
from modalgate.gateway.gate.auth import ApiKeyAuth, configured_keys
from modalgate.gateway.gate.middleware import (
    DEFAULT_PATHS,
    DEFAULT_RESPONSES_PATHS,
    ModalGate,
    get_verdict,
)
from modalgate.gateway.gate.outcome import GateOutcome
from modalgate.gateway.gate.send import json_bytes
from modalgate.gateway.observability.logs import configure_logging, log_outcome
from modalgate.gateway.observability.metrics import GatewayMetrics, metrics_endpoint
from modalgate.gateway.observability.request_id import RequestId
from modalgate.gateway.observability.startup import in_effect
from modalgate.gateway.own_routes import OwnPathsFirst, OwnRoute
from modalgate.gateway.reload import PolicyReloader
from modalgate.gateway.service.authz import (
    AllowChecked,
    AuthzChecks,
    authz_policy,
    authz_problems,
)
from modalgate.gateway.service.catalog import ModelCatalog
from modalgate.gateway.service.drain import Drain
from modalgate.gateway.service.dry_run import dry_run_endpoint
from modalgate.gateway.service.embeds import unserved_embeds
from modalgate.gateway.service.encode import ENCODE_PATH, encode_endpoint
from modalgate.gateway.service.extproc import ExtProcAllow, extproc_problems
from modalgate.gateway.service.health import Readiness
from modalgate.gateway.upstream.balancer import UpstreamRoute, Upstreams
from modalgate.gateway.upstream.engines import EngineDialects
from modalgate.gateway.upstream.forward import Forwarder
from modalgate.gateway.upstream.proxy import UpstreamSettings
from modalgate.policy import Policy, ResolvedRule, RuleMatcher, load_policy
from modalgate.settings import GatewaySettings, load_settings, policy_location

VALIDATE_PATH = "/v1/validate"
VALIDATE_RESPONSES_PATH = "/v1/validate/responses"  # a Responses API body's verdict
MODELS_PATH = "/v1/models"
RETIRED_GRACE_S = 60.0  # a replaced fetcher or upstream pool outlives its last requests
logger = logging.getLogger("modalgate.gateway")


class Gateway:
    """Every part of one gateway, built from one policy and one settings object."""

    def __init__(
        self,
        policy: Policy,
        settings: GatewaySettings,
        encoder: EncoderAdapter | None = None,
        extproc: bool = False,
    ) -> None:
        self.settings = settings
        # (matcher, the default route's model lists, what they give): see _listed_models
        self._listed_cache: tuple[RuleMatcher, tuple, tuple[frozenset[str], str | None]] | None
        self._listed_cache = None
        self.metrics = GatewayMetrics()
        self.adapters_by_spec = _encoders_for(policy, settings.mode)
        self.default_encoder = encoder
        if settings.authz_prefix and settings.upstream:
            raise ValueError("--authz-prefix answers Envoy, which forwards: no --upstream with it")
        if extproc and (settings.upstream or settings.authz_prefix):
            raise ValueError("extproc answers Envoy, which forwards: no --upstream with it")
        if settings.check_prefix and (settings.upstream or settings.authz_prefix or extproc):
            raise ValueError(
                "--check-prefix answers Envoy, which forwards: no --upstream, --authz-prefix"
                " or extproc with it"
            )
        # Decides for Envoy, which forwards: ext_proc's gRPC, or its answer over HTTP.
        self.envoy_decides = extproc or bool(settings.check_prefix)
        problems = self.problems(policy)
        if problems:
            raise ValueError("; ".join(problems))
        self.upstreams = Upstreams(
            settings.upstream,
            UpstreamSettings(
                connect_timeout_s=settings.upstream_connect_timeout_s,
                read_timeout_s=settings.upstream_read_timeout_s,
                write_timeout_s=settings.upstream_write_timeout_s,
                max_connections=settings.upstream_max_connections,
            ),
            settings.upstream_health_path,
            on_upstream=self.metrics.observe_upstream,
            on_response_end=self.metrics.observe_stream_end,
        )
        self.upstreams.use_policy(RuleMatcher(policy, settings.mode).rules)
        self.readiness = Readiness(self.upstreams)
        # A gateway with no upstream at start is a validation service: chat paths answer
        # with the verdict. Routes a reload brings apply to gateways that proxy.
        self.proxying = self.upstreams.configured
        self.catalog = ModelCatalog(lambda: self.gate.matcher, self.upstreams)
        self.router = Router(routes=self._routes(), lifespan=self._lifespan)
        self.router.default = Forwarder(
            self.upstreams, self.adapter_for, lambda path: self.gate.endpoints.kind_of(path)
        )
        own: ASGIApp = OwnPathsFirst(self.router)
        if settings.authz_prefix:
            own = AllowChecked(own)
        elif extproc:
            own = ExtProcAllow(own)
        elif settings.check_prefix:
            own = ExtProcAllow(own, body_back="rewritten")
        self.gate = ModalGate(
            own,
            policy=self._applied(policy),
            mode=settings.mode,
            paths=[VALIDATE_PATH, *DEFAULT_PATHS, *([ENCODE_PATH] if self.adapters else [])],
            on_outcome=self._observe,
            responses_paths=[VALIDATE_RESPONSES_PATH, *DEFAULT_RESPONSES_PATHS],
            served_model=self.served_model,
            dialect=EngineDialects(self.upstreams, settings),
            engine=settings.engine,
            api_keys=(),  # ApiKeyAuth, outside, locks every path
            # Shadow mode forwards: where the verdict is the answer, it is the verdict.
            enforce=(None if settings.enforce else False)
            if self.proxying or self.envoy_decides
            else True,
            enforced_paths=[VALIDATE_PATH, VALIDATE_RESPONSES_PATH, ENCODE_PATH],
        )
        self.gate.verdict_cache.on_lookup = self.metrics.verdict_cache_lookup
        self.reloader = (
            PolicyReloader(
                settings.policy,
                self.apply_policy,
                check=self.problems,
                on_result=self.metrics.policy_reload,
            )
            if settings.policy
            else None
        )
        gate: ASGIApp = self.gate
        checks_under = settings.authz_prefix or settings.check_prefix
        if checks_under:
            gate = AuthzChecks(gate, checks_under)
        # The lock comes before anything reads a body; inside RequestId, which reads only
        # the id header, so a refused request still has an id and an access line.
        self.api_keys = configured_keys(settings.api_keys, settings.api_key_file)
        locked = ApiKeyAuth(gate, self.api_keys, open_paths=self.open_paths())
        # Outermost: the drain counts every request in flight (``modalgate serve`` enables it).
        self.drain = Drain(
            RequestId(locked, access_log=settings.access_log),
            self.readiness,
            settings.grace_period_s,
        )
        self.app: ASGIApp = self.drain
        for spec, adapter in self.adapters_by_spec.items():
            self.metrics.watch_encoder(adapter, spec.partition(":")[0])
        if encoder is not None:
            self.metrics.watch_encoder(encoder, encoder.name)
        self._group: anyio.abc.TaskGroup | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    @property
    def adapters(self) -> list[EncoderAdapter]:
        default = [self.default_encoder] if self.default_encoder is not None else []
        return [*self.adapters_by_spec.values(), *default]

    def adapter_for(self, spec: str | None) -> EncoderAdapter | None:
        if spec:
            return self.adapters_by_spec.get(spec, self.default_encoder)
        return self.default_encoder

    def problems(self, policy: Policy) -> list[str]:
        """What makes ``policy`` unusable in this process: checked at start and on reload."""
        mode = self.settings.mode
        problems = self.encoder_problems(policy) + fallback_problems(policy, mode)
        if self.envoy_decides:
            problems += extproc_problems(policy, mode)
        return problems + (authz_problems(policy, mode) if self.settings.authz_prefix else [])

    def _applied(self, policy: Policy) -> Policy:
        """The policy as this process applies it (a decision service inlines nothing)."""
        return authz_policy(policy) if self.settings.authz_prefix else policy

    def encoder_problems(self, policy: Policy) -> list[str]:
        """Rules this process could not serve: an encoder named after start, or embeds
        with no encoder at all. A reload that brings them is refused."""
        rules = RuleMatcher(policy, self.settings.mode).rules
        problems = [
            f"rule {rule.name!r}: encoder {rule.encoder!r} was not loaded at start "
            "(encoders change on restart)"
            for rule in rules
            if rule.encoder
            and rule.encoder not in self.adapters_by_spec
            and rule.embeds is None  # unserved_embeds names those
        ]
        default = self.default_encoder is not None
        return problems + unserved_embeds(rules, self.adapters_by_spec, default=default)

    def apply_policy(self, policy: Policy) -> None:
        retired: list[object] = [self.gate.media]
        self.gate.set_policy(self._applied(policy), self.settings.mode)
        retired += [target.proxy for target in self.upstreams.use_policy(self.gate.matcher.rules)]
        if self._group is not None:
            for resource in retired:
                self._group.start_soon(_close_later, resource)
            self._group.start_soon(self.catalog.refresh)

    def served_model(self, name: str, rule: ResolvedRule) -> str | None:
        """The model that really answers a request judged as ``name``, if not that one.

        The default upstream serves whatever name a request carries (SGLang ignores
        names; vLLM serves its default model when none is given), so a request routed
        there is judged as what it serves: ``--served-model``, else the one model its
        ``/v1/models`` listed that the policy knows (an id the policy does not know
        says no more than the name the client sent). A rule's own upstream serves
        that rule's model: the policy says so.
        """
        if self.settings.authz_prefix or self.envoy_decides:  # Envoy's upstream: the operator's
            return self.settings.served_model
        route = self.upstreams.route_for(rule)
        if route is None or route is not self.upstreams.default:
            return None
        if self.settings.served_model:
            return self.settings.served_model
        listed, only_known = self._listed_models(route)
        return None if name.casefold() in listed else only_known

    def _listed_models(self, route: UpstreamRoute) -> tuple[frozenset[str], str | None]:
        """The route's listed ids (casefolded) and its one policy-known model, if one.

        Read per request on the hot path, so kept until the lists or the policy change.
        """
        matcher = self.gate.matcher
        lists = tuple(target.served for target, _ in route.targets)
        cached = self._listed_cache
        if cached is not None and cached[0] is matcher and cached[1] == lists:
            return cached[2]
        listed = {model for served in lists for model in served}
        known = {m.casefold(): m for m in listed if matcher.resolve(m).known}
        value = (
            frozenset(m.casefold() for m in listed),
            next(iter(known.values())) if len(known) == 1 else None,
        )
        self._listed_cache = (matcher, lists, value)
        return value

    def open_paths(self) -> list[str]:
        """What a prober or scraper reaches without a key (unless told to ask for one)."""
        if self.settings.auth_health_and_metrics:
            return []
        return ["/healthz", "/readyz", self.settings.metrics_path]

    def _observe(self, outcome: GateOutcome) -> None:
        self.metrics.observe_outcome(outcome)
        log_outcome(outcome)

    def protocol_refused(self, violation: Violation) -> None:
        """Counted as a refusal before any verdict (``modalgate_requests_total``): serve's
        protocol answered the request itself (``http/protocol.py``'s ``PROTOCOL_REFUSED``) and
        logged it there."""
        self.metrics.observe_outcome(GateOutcome.early_refusal(violation, self.gate.mode, ""))

    def _routes(self) -> list[Route]:
        routes = [
            OwnRoute("/healthz", _healthz, methods=["GET", "HEAD"]),
            OwnRoute("/readyz", self.readiness.endpoint, methods=["GET", "HEAD"]),
            OwnRoute(self.settings.metrics_path, metrics_endpoint(self.metrics), methods=["GET"]),
            OwnRoute(VALIDATE_PATH, _verdict, methods=["POST"]),
            OwnRoute(VALIDATE_RESPONSES_PATH, _verdict, methods=["POST"]),
            OwnRoute(MODELS_PATH, self.catalog.list_endpoint, methods=["GET"]),
            OwnRoute(
                MODELS_PATH + "/{model_id:path}", self.catalog.model_endpoint, methods=["GET"]
            ),
        ]
        if not self.proxying:
            gated = (*DEFAULT_PATHS, *DEFAULT_RESPONSES_PATHS)
            routes += [OwnRoute(p, dry_run_endpoint, methods=["POST"]) for p in gated]
        if self.adapters:
            routes.append(
                OwnRoute(
                    ENCODE_PATH,
                    encode_endpoint(self.default_encoder, self.adapters_by_spec),
                    methods=["POST"],
                )
            )
        return routes

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: object) -> AsyncIterator[None]:
        for adapter in self.adapters:
            await adapter.warmup()
        self.readiness.encoders_warm = True
        if self.upstreams.configured:
            # Know what the upstreams serve before the first request is judged (each list
            # read is bounded by MODEL_LIST_TIMEOUT_S). One down now is read when the health
            # watch or a readiness probe finds it answering; until then, judged by name.
            await self.catalog.refresh()
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                if self.reloader is not None:
                    group.start_soon(self.reloader.run, self.settings.watch_policy)
                if self.upstreams.configured:
                    group.start_soon(self.upstreams.watch, self.settings.upstream_health_interval_s)
                logger.info("gateway started", extra={"fields": in_effect(self)})
                try:
                    yield
                finally:
                    self._group = None
                    group.cancel_scope.cancel()
        finally:
            await self.upstreams.aclose()
            for adapter in self.adapters:
                await adapter.close()
            self.metrics.worker_exited()


async def _close_later(resource: object) -> None:
    """Close what a reload replaced once requests using it are done, or at shutdown."""
    try:
        await anyio.sleep(RETIRED_GRACE_S)
    finally:
        with anyio.CancelScope(shield=True):
            await resource.aclose()  # type: ignore[attr-defined]


def fallback_problems(policy: Policy, mode: str | None) -> list[str]:
    """Fallbacks must land on a rule of this mode that takes the modality they route."""
    matcher = RuleMatcher(policy, mode)
    problems = []
    for rule in matcher.rules:
        for modality, target in (rule.fallback or {}).items():
            resolved = matcher.resolve(target)
            if not resolved.known:
                problems.append(
                    f"rule {rule.name!r}: fallback for {modality} names {target!r}, "
                    f"which no rule{' of mode ' + repr(mode) if mode else ''} matches"
                )
            elif modality not in resolved.accepts:
                problems.append(
                    f"rule {rule.name!r}: fallback for {modality} names {target!r}, "
                    f"whose rule {resolved.name!r} does not accept {modality}"
                )
    return problems


def _encoders_for(policy: Policy, mode: str | None) -> dict[str, EncoderAdapter]:
    specs = {r.encoder for r in RuleMatcher(policy, mode).rules if r.encoder}
    return {spec: create_encoder(spec) for spec in sorted(specs)}


async def _verdict(request: Request) -> Response:
    verdict = get_verdict(request.scope)
    if verdict is None:  # only reachable if the app is served without its gate
        return Response(status_code=500)
    return Response(json_bytes(verdict.to_dict()), media_type="application/json")


async def _healthz(request: Request) -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


def create_app(
    policy: Policy | str | PathLike[str] | None = None,
    mode: str | None = None,
    encoder: EncoderAdapter | None = None,
    *,
    upstream: str | None = None,
    settings: GatewaySettings | None = None,
    extproc: bool = False,
) -> Gateway:
    """The gateway app. Arguments given here win over ``MODALGATE_*`` variables, which win
    over the policy file's ``server:`` section; ``encoder`` serves rules without their own.

    Called bare by another ASGI server (``create_app()``), it also loads the encoder
    named by ``MODALGATE_ENCODER`` and, unless logging is configured already, writes
    the gateway's log lines as ``modalgate serve`` does.
    """
    if settings is None:
        flags = {"mode": mode, "upstream": upstream}
        if policy is not None and not isinstance(policy, Policy):
            flags["policy"] = str(policy)
        location = policy_location(flags)
        if not isinstance(policy, Policy):
            policy = load_policy(location)
        settings = load_settings(
            {**flags, "policy": location}, policy.server.model_dump(exclude_none=True)
        )
    elif not isinstance(policy, Policy):
        policy = load_policy(policy if policy is not None else settings.policy)
    if encoder is None and settings.encoder:
        try:
            encoder = create_encoder(settings.encoder)
        except (LookupError, ValueError, OSError, RuntimeError) as exc:
            raise StartupError(f"cannot start the encoder: {exc}") from exc
    if not logging.getLogger().handlers and not logging.getLogger("modalgate").handlers:
        configure_logging(settings.log_level, settings.log_format)
    try:
        return Gateway(policy, settings, encoder, extproc=extproc)
    except (LookupError, ValueError, OSError, RuntimeError) as exc:
        raise StartupError(f"cannot start: {exc}") from exc


class StartupError(RuntimeError):
    """What keeps a gateway from starting, in one line fit for an operator."""
