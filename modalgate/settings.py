"""The gateway's settings: one model, from which every place that sets them is made.

``GatewaySettings`` (pydantic-settings) is the only definition. The
``MODALGATE_*`` variables are its environment source; the policy file's
``server:`` section (``ServerSection``) and the ``modalgate serve`` flags are
derived from its fields, types, constraints and descriptions, so none of them
can name a setting the others lack or check it differently. Precedence: flags,
then the environment, then the policy file, then the defaults here.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    create_model,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, InitSettingsSource, NoDecode, SettingsConfigDict

ENV_PREFIX = "MODALGATE_"


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError("the upstream must be an http:// or https:// URL")
    return upstream_root(value)


def upstream_root(url: str) -> str:
    """The server root under an upstream URL: ``http://h:8001/v1`` -> ``http://h:8001``.

    Clients know a server by its OpenAI ``base_url`` (ending in ``/v1``), while the
    proxy appends the path a client sent (``/v1/chat/completions``), so either form is
    taken and the ``/v1`` dropped once, here. A path before it stays: a prefix under
    which the server is mounted (``http://h/llm/v1`` -> ``http://h/llm``).
    """
    root = url.rstrip("/")
    return root.removesuffix("/v1") if root.endswith("/v1") else root


def _api_keys(value: object) -> object:
    """``MODALGATE_API_KEYS=a,b``, ``--api-key a --api-key b,c``, or a list in a policy file."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list | tuple):
        texts = (i.get_secret_value() if isinstance(i, SecretStr) else str(i) for i in value)
        return tuple(key.strip() for text in texts for key in text.split(",") if key.strip())
    return value


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must start with /")
    return value


def _authz_prefix(value: str) -> str:
    if not value.strip("/"):
        raise ValueError(
            "must name a path under / (e.g. /ext-authz): under / every request, /healthz"
            " and /metrics included, would be taken for a check"
        )
    return value


UpstreamUrl = Annotated[str, AfterValidator(_http_url)]
AbsolutePath = Annotated[str, AfterValidator(_absolute)]
AuthzPrefix = Annotated[str, AfterValidator(_absolute), AfterValidator(_authz_prefix)]
Seconds = Annotated[float, Field(gt=0)]
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
# The model server behind an upstream, whose request parsing the gate follows.
Engine = Literal["vllm", "sglang", "openai"]


class EngineSpec(BaseModel):
    """An upstream's engine and the server flags that change how it parses requests
    (modalgate/validators/dialects.py): a rule's ``engine:``, or the default upstream's
    ``--engine`` and flags. ``engine: vllm`` is short for ``{name: vllm}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Engine
    enable_mm_embeds: bool = False  # vLLM --enable-mm-embeds
    enable_prompt_embeds: bool = False  # vLLM --enable-prompt-embeds
    trust_request_mm_kwargs: bool = False  # vLLM --trust-request-mm-kwargs


# Secrets: never in a repr, a log line or an error message.
ApiKeys = Annotated[tuple[SecretStr, ...], NoDecode, BeforeValidator(_api_keys)]


def _flag(metavar: str, name: str | None = None) -> dict[str, Any]:
    """The placeholder the field's ``serve`` flag shows in ``--help``, and the flag's own
    name where it is not made from the field's."""
    return {"metavar": metavar, **({"flag": name} if name else {})}


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    policy: str | None = Field(
        None,
        description="policy file (default: the built-in table)",
        json_schema_extra=_flag("FILE"),
    )
    mode: str | None = Field(
        None, description="deployment mode, e.g. encoder", json_schema_extra=_flag("MODE")
    )
    upstream: UpstreamUrl | None = Field(
        None,
        description="the model server to forward to, with or without /v1; none: a validation"
        " service",
        json_schema_extra=_flag("URL"),
    )
    served_model: str | None = Field(
        None,
        min_length=1,
        description="the model the default upstream serves: requests routed there are judged"
        " as it, whatever name they carry (default: the one policy-known model its"
        " /v1/models lists)",
        json_schema_extra=_flag("NAME"),
    )
    engine: Engine | None = Field(
        None,
        description="the default upstream's engine, whose request parsing the gate follows"
        " (default: what its /v1/models owned_by says, else openai)",
        json_schema_extra=_flag("ENGINE"),
    )
    enable_mm_embeds: bool = Field(
        False, description="the default upstream is vLLM started with --enable-mm-embeds"
    )
    enable_prompt_embeds: bool = Field(
        False, description="the default upstream is vLLM started with --enable-prompt-embeds"
    )
    trust_request_mm_kwargs: bool = Field(
        False,
        description="the default upstream is vLLM started with --trust-request-mm-kwargs",
    )
    encoder: str | None = Field(
        None,
        description="encoder adapter for /v1/encode and embeds rewrites, e.g."
        " kimi:/models/kimi-vit",
        json_schema_extra=_flag("NAME[:ARG]"),
    )
    authz_prefix: AuthzPrefix | None = Field(
        None,
        description="answer Envoy's ext_authz checks under this path (its http_service"
        " path_prefix) instead of proxying: Envoy forwards, the gate decides (docs/envoy.md)",
        json_schema_extra=_flag("PATH"),
    )
    check_prefix: AuthzPrefix | None = Field(
        None,
        description="answer checks that take a rewritten body back (Envoy's Lua filter,"
        " deploy/envoy/envoy-lua.yaml) under this path instead of proxying: the whole policy"
        " applies, as in ext_proc (docs/envoy.md)",
        json_schema_extra=_flag("PATH"),
    )
    host: str = Field("127.0.0.1", description="bind address", json_schema_extra=_flag("H"))
    port: int = Field(8000, ge=0, le=65535, description="port", json_schema_extra=_flag("P"))
    workers: int = Field(
        1,
        ge=1,
        description="worker processes sharing the port (one /metrics for all of them)",
        json_schema_extra=_flag("N"),
    )
    client_timeout_s: Seconds = Field(
        60.0,
        description="the longest silence from a client while its request is read (headers"
        " and body): 408 request_timeout past it, and the connection closed",
        json_schema_extra=_flag("S"),
    )
    client_header_timeout_s: Seconds = Field(
        20.0,
        description="the longest a request line and headers may take to arrive, from their"
        " first byte, however steadily they come: 408 request_timeout past it, and the"
        " connection closed",
        json_schema_extra=_flag("S"),
    )
    client_body_timeout_s: Seconds = Field(
        60.0,
        description="the longest a request body may take to arrive, from the end of its"
        " headers, plus 1 s for every client_body_min_rate bytes of it received: 408"
        " request_timeout past it, and the connection closed",
        json_schema_extra=_flag("S"),
    )
    client_body_min_rate: int = Field(
        32 * 1024,
        ge=1,
        description="bytes of a request body that earn its client 1 s more than"
        " client_body_timeout_s: a body that keeps coming at this rate is never cut off",
        json_schema_extra=_flag("BYTES"),
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="the longest request line and headers together: 431 headers_too_large"
        " past it, and the connection closed",
        json_schema_extra=_flag("N"),
    )
    upstream_connect_timeout_s: Seconds = Field(
        5.0, description="connecting to an upstream", json_schema_extra=_flag("S")
    )
    upstream_read_timeout_s: Seconds = Field(
        300.0,
        description="the longest silence between two chunks of a response",
        json_schema_extra=_flag("S"),
    )
    upstream_write_timeout_s: Seconds = Field(
        60.0,
        description="the longest an upstream may take to accept one chunk of a request body",
        json_schema_extra=_flag("S"),
    )
    upstream_max_connections: int = Field(
        512,
        gt=0,
        description="connection pool size, per upstream URL",
        json_schema_extra=_flag("N"),
    )
    upstream_health_path: AbsolutePath = Field(
        "/health",
        description="probed on every upstream for fail-over (readiness asks /v1/models)",
        json_schema_extra=_flag("PATH"),
    )
    upstream_health_interval_s: Seconds = Field(
        5.0,
        description="seconds between health probes of each upstream",
        json_schema_extra=_flag("S"),
    )
    enforce: bool = Field(
        True,
        description="refuse what the policy refuses; --no-enforce: shadow mode for every rule"
        " (forwarded anyway, logged, counted, named in x-modalgate-shadow)",
    )
    grace_period_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, seconds to let requests and streams in flight finish",
        json_schema_extra=_flag("S"),
    )
    watch_policy: bool = Field(
        True, description="reload the policy file when it changes (SIGHUP always reloads)"
    )
    metrics_path: AbsolutePath = Field(
        "/metrics", description="where Prometheus scrapes", json_schema_extra=_flag("PATH")
    )
    access_log: bool = Field(True, description="one log line per request")
    log_format: Literal["json", "text"] = Field("json", description="log line format")
    log_level: LogLevel = Field("info", description="the lowest level logged")
    api_keys: ApiKeys = Field(
        (),
        description="bearer keys clients must send, comma separated or the flag repeated"
        " (a flag shows in ps: prefer the variable or --api-key-file); none: no authentication",
        json_schema_extra=_flag("KEY", name="--api-key"),
    )
    api_key_file: str | None = Field(
        None,
        description="a file of bearer keys, one a line (kept off the command line);"
        " joins --api-key",
        json_schema_extra=_flag("FILE"),
    )
    auth_health_and_metrics: bool = Field(
        False,
        description="with keys, ask for one on /healthz, /readyz and the metrics path too",
    )


class RaySettings(BaseSettings):
    """Where the Ray Serve encoder pool is and how the gateway calls it (``--encoder
    ray:APP``): ``MODALGATE_RAY_*`` variables, read through this model like the rest."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "RAY_", extra="ignore", frozen=True)

    address: str = Field("auto", description="the Ray cluster to join as a driver")
    timeout_s: Seconds = Field(30.0, description="one call to the pool")
    retries: int = Field(1, ge=0, description="calls retried on a lost replica")
    coalesce_ms: float = Field(2.0, ge=0, description="window that joins concurrent requests")


# What a policy file's ``server:`` section may set: every setting but the file's own place,
# and the shadow-mode switch (the policy says ``enforce`` at its top level, per rule too).
NOT_IN_POLICY_FILE = frozenset({"policy", "enforce"})


def _optional(field: FieldInfo) -> tuple[Any, Any]:
    annotation = field.rebuild_annotation()  # the type with its constraints and validators
    return Optional[annotation], Field(None, description=field.description)  # noqa: UP045


ServerSection: type[BaseModel] = create_model(
    "Server",
    __config__=ConfigDict(extra="forbid", frozen=True),
    __doc__="Gateway settings a policy file may carry: the lowest precedence, under flags and"
    " MODALGATE_* variables (docs/deploy.md). Read at start, not on reload.",
    **{
        name: _optional(field)
        for name, field in GatewaySettings.model_fields.items()
        if name not in NOT_IN_POLICY_FILE
    },
)


def flag_name(field_name: str) -> str:
    """``upstream_read_timeout_s`` -> ``--upstream-read-timeout`` (seconds are said in help);
    a field may name its flag (``api_keys`` -> ``--api-key``, given once per key)."""
    field = GatewaySettings.model_fields.get(field_name)
    extra = field.json_schema_extra if field is not None else None
    if isinstance(extra, dict) and isinstance(extra.get("flag"), str):
        return extra["flag"]
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


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
