"""``/readyz``: ready means the policy is loaded, every route has a server that answers its
model list, the encoders are warm; when not ready, the body says which upstream and why.

An upstream is ready when ``GET /v1/models`` answers 200 with a model list: what
every OpenAI-compatible server serves, and what a wrong base URL or a server still
loading its weights does not (a plain ``/health`` below 500 said "ready" for an
upstream that answered every request with 404). The fail-over probe of the balancer
stays separate: a server that answers at all can still take requests.

Load balancers poll this often; answers younger than a second are reused, and
polls that arrive together wait for one probe, so a thousand polls cost one probe
per upstream.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response

from modalgate.gateway.gate.send import json_bytes
from modalgate.gateway.service.catalog import learn_models
from modalgate.gateway.upstream.balancer import Target, UpstreamRoute, Upstreams

PROBE_MAX_AGE_S = 1.0
PROBE_TIMEOUT_S = 2.0
MODELS_PATH = "/v1/models"


@dataclass(frozen=True, slots=True)
class UpstreamState:
    checked_at: float
    reason: str | None  # None: ready

    def as_dict(self) -> dict[str, object]:
        return {"ready": True} if self.reason is None else {"ready": False, "reason": self.reason}


class Readiness:
    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams
        self.encoders_warm = False
        self.draining = False  # SIGTERM under modalgate serve: requests in flight finishing
        self._states: dict[str, UpstreamState] = {}
        self._lock = anyio.Lock()

    async def endpoint(self, request: Request) -> Response:
        if self.draining:  # out of the balancer at once; nothing else to probe
            body = json_bytes({"status": "not_ready", "reason": "draining"})
            return Response(body, 503, media_type="application/json")
        # The routes and the states of their targets from one snapshot: a reload while
        # the probes run must not leave a route with a target that was never probed.
        served, states = await self.snapshot()
        routes = {route.name: _route_ready(route, states) for route in served}
        checks: dict[str, object] = {
            "policy": True,  # the gateway does not start without one; reloads are atomic
            "upstream": all(routes.values()),
            "encoders": self.encoders_warm,
        }
        ready = all(checks.values())
        if len(routes) > 1:
            checks["routes"] = routes
        body: dict[str, object] = {"status": "ready" if ready else "not_ready", "checks": checks}
        if states:
            body["upstreams"] = {url: state.as_dict() for url, state in states.items()}
        return Response(json_bytes(body), 200 if ready else 503, media_type="application/json")

    async def upstream_states(self) -> dict[str, UpstreamState]:
        """Each upstream's state, probed again where older than ``PROBE_MAX_AGE_S``."""
        _, states = await self.snapshot()
        return states

    async def snapshot(self) -> tuple[list[UpstreamRoute], dict[str, UpstreamState]]:
        """The routes as they were when the probes started, and the state of each of
        their targets (probed again where older than ``PROBE_MAX_AGE_S``)."""
        async with self._lock:
            routes = self.upstreams.routes
            targets = {target.url: target for route in routes for target, _ in route.targets}
            now = time.monotonic()
            stale = [
                target
                for url, target in targets.items()
                if url not in self._states or now - self._states[url].checked_at >= PROBE_MAX_AGE_S
            ]
            async with anyio.create_task_group() as group:
                for target in stale:
                    group.start_soon(self._probe, target)
            self._states = {url: self._states[url] for url in targets}
            return routes, self._states

    async def _probe(self, target: Target) -> None:
        reason = await models_problem(target)
        self._states[target.url] = UpstreamState(time.monotonic(), reason)


def _route_ready(route: UpstreamRoute, states: dict[str, UpstreamState]) -> bool:
    """A target with no state (none should lack one) counts as not ready."""
    for target, _ in route.targets:
        state = states.get(target.url)
        if state is not None and state.reason is None:
            return True
    return False


async def models_problem(target: Target) -> str | None:
    """Why ``target`` is not ready, in words for an operator; None when it is."""
    try:
        response = await target.proxy.get(MODELS_PATH, PROBE_TIMEOUT_S)
    except (httpx.TimeoutException, TimeoutError):
        return f"timeout: no answer from {MODELS_PATH} within {PROBE_TIMEOUT_S:g} s"
    except httpx.ConnectError as exc:
        return _connect_problem(exc)
    except httpx.HTTPError:
        return f"no valid HTTP answer from {MODELS_PATH}"
    if response.status_code != 200:
        return f"status {response.status_code} from {MODELS_PATH}"
    try:
        listed = response.json().get("data")
    except (ValueError, AttributeError):
        listed = None
    if not isinstance(listed, list):
        return f"status 200 from {MODELS_PATH}, but not a model list"
    learn_models(target, listed)  # what it serves now, as the gate judges its requests
    return None


def _connect_problem(exc: httpx.ConnectError) -> str:
    os_error = getattr(exc.__cause__, "os_error", None)
    if isinstance(os_error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(os_error, socket.gaierror):
        return "host not found"
    if isinstance(os_error, OSError) and os_error.strerror:
        return f"cannot connect: {os_error.strerror.lower()}"
    return "cannot connect"
