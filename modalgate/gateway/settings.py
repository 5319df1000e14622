"""The gateway's settings, from three places in a fixed order.

Flags win over ``MODALGATE_*`` environment variables, which win over the
policy file's ``server:`` section, which wins over the defaults here. The policy
file's own location comes from the flag or ``MODALGATE_POLICY`` only.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict

ENV_PREFIX = "MODALGATE_"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    policy: str | None = None
    mode: str | None = None
    upstream: str | None = None
    served_model: str | None = None  # what the default upstream serves, whatever the name
    encoder: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    upstream_connect_timeout_s: float = Field(5.0, gt=0)
    upstream_read_timeout_s: float = Field(300.0, gt=0)
    upstream_write_timeout_s: float = Field(60.0, gt=0)
    upstream_max_connections: int = Field(512, gt=0)
    upstream_health_path: str = "/health"
    upstream_health_interval_s: float = Field(5.0, gt=0)
    grace_period_s: float = Field(30.0, ge=0)
    watch_policy: bool = True
    metrics_path: str = "/metrics"
    access_log: bool = True
    log_format: Literal["json", "text"] = "json"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("upstream")
    @classmethod
    def _http_upstream(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("the upstream must be an http:// or https:// URL")
        return value.rstrip("/") if value else value

    @field_validator("metrics_path", "upstream_health_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        return value


def policy_location(flags: dict[str, Any]) -> str | None:
    """Where the policy file is: the flag, else the environment, else the built-in table."""
    return flags.get("policy") or os.environ.get(f"{ENV_PREFIX}POLICY") or None


def load_settings(flags: dict[str, Any], policy_server: dict[str, Any]) -> GatewaySettings:
    """Flags (None = not given) over the environment over the policy's ``server:`` section."""
    given = {key: value for key, value in flags.items() if value is not None}

    class _Sourced(GatewaySettings):
        @classmethod
        def settings_customise_sources(
            cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        ):
            return (init_settings, env_settings, InitSettingsSource(settings_cls, policy_server))

    return GatewaySettings.model_validate(_Sourced(**given).model_dump())
