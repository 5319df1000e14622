"""The gateway's settings; defined once in ``modalgate.settings`` (flags, environment, policy)."""

from modalgate.settings import (
    ENV_PREFIX,
    GatewaySettings,
    ServerSection,
    env_name,
    flag_name,
    load_settings,
    policy_location,
)

__all__ = [
    "ENV_PREFIX",
    "GatewaySettings",
    "ServerSection",
    "env_name",
    "flag_name",
    "load_settings",
    "policy_location",
]
