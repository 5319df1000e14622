"""The standalone gateway app behind ``modalgate serve``.

Until the upstream proxy lands, the gateway answers the chat paths itself: an
accepted request gets its verdict (200), a refused one the error (4xx) that
ModalGate sends before this app ever sees it. With an encoder adapter it also
serves ``POST /v1/encode`` (the encoder of an Encode/Prefill/Decode split).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from os import PathLike

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from modalgate.encoder_adapter import EncoderAdapter, create_encoder
from modalgate.gateway.encode import ENCODE_PATH, encode_endpoint
from modalgate.gateway.middleware import DEFAULT_PATHS, ModalGate, get_verdict
from modalgate.gateway.responses import json_bytes
from modalgate.policy import Policy, load_policy

VALIDATE_PATH = "/v1/validate"


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
) -> ASGIApp:
    """The gateway app; ``encoder`` serves /v1/encode for rules without their own ``encoder:``."""
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    paths = [VALIDATE_PATH, *DEFAULT_PATHS]
    routes = [Route(p, _verdict, methods=["POST"]) for p in paths]
    routes.append(Route("/healthz", _healthz, methods=["GET"]))
    specs = {r.encoder for r in policy.models if r.encoder and r.mode in (None, mode)}
    by_spec = {spec: create_encoder(spec) for spec in sorted(specs)}
    adapters = [*by_spec.values(), *([encoder] if encoder is not None else [])]
    if adapters:
        routes.append(Route(ENCODE_PATH, encode_endpoint(encoder, by_spec), methods=["POST"]))
        paths.append(ENCODE_PATH)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for adapter in adapters:
            await adapter.warmup()
        try:
            yield
        finally:
            for adapter in adapters:
                await adapter.close()

    inner = Starlette(routes=routes, lifespan=lifespan)
    return ModalGate(inner, policy=policy, mode=mode, paths=paths)
