"""``/readyz``: ready means the policy is loaded, the upstream answers, the encoders are warm.

Load balancers poll this often; the upstream probe is cached for a moment so
a thousand polls cost one request to the model server.
"""

from __future__ import annotations

import time

import httpx
from starlette.requests import Request
from starlette.responses import Response

from modalgate.gateway.proxy import UpstreamProxy
from modalgate.gateway.responses import json_bytes

PROBE_TTL_S = 1.0
PROBE_TIMEOUT_S = 2.0


class Readiness:
    def __init__(self, proxy: UpstreamProxy | None, health_path: str) -> None:
        self.proxy = proxy
        self.health_path = health_path
        self.encoders_warm = False
        self._probed_at = -PROBE_TTL_S
        self._upstream_ok = False

    async def upstream_reachable(self) -> bool:
        if self.proxy is None:
            return True
        now = time.monotonic()
        if now - self._probed_at < PROBE_TTL_S:
            return self._upstream_ok
        url = self.proxy.base_url.join(self.proxy.base_url.path.rstrip("/") + self.health_path)
        try:
            response = await self.proxy.client.get(url, timeout=PROBE_TIMEOUT_S)
            self._upstream_ok = response.status_code < 500
        except httpx.HTTPError:
            self._upstream_ok = False
        self._probed_at = time.monotonic()
        return self._upstream_ok

    async def endpoint(self, request: Request) -> Response:
        checks = {
            "policy": True,  # the gateway does not start without one; reloads are atomic
            "upstream": await self.upstream_reachable(),
            "encoders": self.encoders_warm,
        }
        ready = all(checks.values())
        body = {"status": "ready" if ready else "not_ready", "checks": checks}
        return Response(json_bytes(body), 200 if ready else 503, media_type="application/json")
