"""``/readyz``: ready means the policy is loaded, every route has a live server, the
encoders are warm.

Load balancers poll this often; upstream states younger than a second are
reused, so a thousand polls cost one probe per upstream.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from modalgate.gateway.gate.send import json_bytes
from modalgate.gateway.upstream.balancer import Upstreams

PROBE_MAX_AGE_S = 1.0


class Readiness:
    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams
        self.encoders_warm = False

    async def endpoint(self, request: Request) -> Response:
        await self.upstreams.probe(max_age_s=PROBE_MAX_AGE_S)
        routes = {route.name: route.up for route in self.upstreams.routes}
        checks: dict[str, object] = {
            "policy": True,  # the gateway does not start without one; reloads are atomic
            "upstream": all(routes.values()),
            "encoders": self.encoders_warm,
        }
        ready = all(checks.values())
        if len(routes) > 1:
            checks["routes"] = routes
        body = {"status": "ready" if ready else "not_ready", "checks": checks}
        return Response(json_bytes(body), 200 if ready else 503, media_type="application/json")
