"""The one start-up line: what a gateway runs with, so an operator reading the log knows
the mode, policy, rules, upstreams, encoders, lock and shadow mode in force without reading flags,
variables and a policy file's ``server:`` section side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Protocol

from modalgate.gateway.gate.shadow import shadow_in_effect

if TYPE_CHECKING:
    from modalgate.encoder_adapter import EncoderAdapter
    from modalgate.gateway.gate.middleware import ModalGate
    from modalgate.gateway.upstream.balancer import Upstreams
    from modalgate.settings import GatewaySettings


class StartedGateway(Protocol):
    """What the line reads of a gateway (``app.Gateway``), named here so that this
    module does not import the app that logs it."""

    settings: GatewaySettings
    upstreams: Upstreams
    adapters_by_spec: Mapping[str, EncoderAdapter]
    default_encoder: EncoderAdapter | None
    proxying: bool
    gate: ModalGate
    api_keys: Sized

    def open_paths(self) -> list[str]: ...


def in_effect(gateway: StartedGateway) -> dict[str, object]:
    """The fields of the ``gateway started`` line; never a key, only how many."""
    settings = gateway.settings
    routes = [
        f"{route.name}={','.join(target.url for target, _ in route.targets)}"
        for route in gateway.upstreams.routes
    ]
    encoders = list(gateway.adapters_by_spec)
    if gateway.default_encoder is not None:
        encoders.append(f"{settings.encoder or gateway.default_encoder.name} (default)")
    return {
        "serving": "proxy" if gateway.proxying else "validation service (dry run)",
        "mode": settings.mode,
        "policy": settings.policy or "built-in",
        "rules": len(gateway.gate.matcher.rules),
        "upstreams": "; ".join(routes) or None,
        "encoders": ", ".join(encoders) or None,
        "api_keys": len(gateway.api_keys),
        "open_paths": ", ".join(gateway.open_paths()) if gateway.api_keys else "all",
        "shadow": shadow_in_effect(gateway.gate.matcher, gateway.gate.enforce),
    }
