"""The gate mounted inside an engine's own app: its settings from the environment, and the
engine's API-key lock honoured before any body is judged.

``vllm serve MODEL --middleware modalgate.ModalGate`` calls ``app.add_middleware(ModalGate)``
with no arguments, so ``ModalGate(app)`` reads what it is not given from the same
``MODALGATE_*`` variables ``modalgate serve`` reads (and the policy file's ``server:``
section under them): policy, mode, engine and its flags, served model, shadow mode, API
keys.

vLLM adds ``--middleware`` classes last, so they run first: the gate sees a request before
vLLM's ``AuthenticationMiddleware`` does. Judging the body of a request vLLM will refuse
would spend a fetch, a probe and a decode on it; so the gate reads vLLM's keys where vLLM
keeps them (``app.state.args.api_key``, else ``VLLM_API_KEY``) and refuses such a request
itself, 401, before reading its body, on the paths vLLM guards.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from os import PathLike
from typing import Any

from starlette.types import Scope

from modalgate.gateway.gate.auth import bearer_token, configured_keys
from modalgate.policy import Policy, load_policy
from modalgate.settings import EngineSpec, GatewaySettings, load_settings, policy_location
from modalgate.validators.dialects import dialect_for


class FromEnvironment:
    """The default of each ``ModalGate`` argument the environment may set."""

    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Any = FromEnvironment()

# vLLM's AuthenticationMiddleware guards these prefixes only (its GUARDED_PREFIX,
# vllm/entrypoints/serve/middleware/authenticate.py), and never OPTIONS.
VLLM_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


@dataclass(frozen=True, slots=True)
class MountSettings:
    """``ModalGate``'s arguments as given; ``FROM_ENV`` where left out."""

    policy: Any
    mode: Any
    served_model: Any
    enforce: Any
    dialect: Any
    engine: Any
    api_keys: Any

    def completed(self) -> tuple[Any, ...]:
        """The arguments with each one left out read from the environment (flags win over
        variables, variables over the policy file's ``server:`` section, as in serve)."""
        given = tuple(getattr(self, f.name) for f in fields(self))  # as given: no copies
        if not any(value is FROM_ENV for value in given):
            return given
        loaded = None if self.policy is FROM_ENV else as_policy(self.policy)
        env_policy, settings = environment(loaded)

        def chosen(value: Any, from_env: Any) -> Any:
            return from_env if value is FROM_ENV else value

        engine = chosen(self.engine, settings.engine)
        dialect = self.dialect
        if dialect is FROM_ENV:
            spec = engine_spec(settings.model_copy(update={"engine": engine}))
            dialect = dialect_for(spec) if spec is not None else None
        return (
            env_policy if self.policy is FROM_ENV else loaded,
            chosen(self.mode, settings.mode),
            chosen(self.served_model, settings.served_model),
            chosen(self.enforce, None if settings.enforce else False),
            dialect,
            engine,
            own_keys(settings) if self.api_keys is FROM_ENV else self.api_keys,
        )


def as_policy(policy: Policy | str | PathLike[str] | None) -> Policy:
    return policy if isinstance(policy, Policy) else load_policy(policy)


def environment(policy: Policy | None = None) -> tuple[Policy, GatewaySettings]:
    """The policy and settings ``modalgate serve`` would take from the environment alone."""
    location = policy_location({})
    if policy is None:
        policy = load_policy(location)
    settings = load_settings({"policy": location}, policy.server.model_dump(exclude_none=True))
    return policy, settings


def engine_spec(settings: GatewaySettings) -> EngineSpec | None:
    if settings.engine is None:
        return None
    flags = {}
    if settings.engine == "vllm":
        flags = {
            "enable_mm_embeds": settings.enable_mm_embeds,
            "enable_prompt_embeds": settings.enable_prompt_embeds,
            "trust_request_mm_kwargs": settings.trust_request_mm_kwargs,
        }
    return EngineSpec(name=settings.engine, **flags)


def own_keys(settings: GatewaySettings) -> list[str]:
    return configured_keys(settings.api_keys, settings.api_key_file)


class KeyLock:
    """Refuses, before its body is read, a request that carries none of the gate's own
    keys (anywhere it judges), or none of the engine's keys where the engine checks them."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(key.encode() for key in keys)
        self._engine_keys: dict[int, tuple[bytes, ...]] = {}

    def refuses(self, scope: Scope) -> bool | None:
        """None: open; False: a key was missing; True: a key was wrong. With no keys of
        its own and none of the engine's (nearly always), the headers are not read."""
        engine = self.engine_keys(scope)
        if not self.keys and not engine:
            return None
        token = bearer_token(scope["headers"])
        if self.keys and not _any_matches(token, self.keys):
            return token is not None
        if engine and _vllm_guards(scope) and not _any_matches(token, engine):
            return token is not None
        return None

    def engine_keys(self, scope: Scope) -> tuple[bytes, ...]:
        """vLLM's keys, read once per app from where vLLM's ``build_app`` keeps its args."""
        app = scope.get("app")
        if app is None:
            return ()
        cached = self._engine_keys.get(id(app))
        if cached is None:
            cached = self._engine_keys[id(app)] = _vllm_keys(app)
        return cached


def _vllm_keys(app: Any) -> tuple[bytes, ...]:
    args = getattr(getattr(app, "state", None), "args", None)
    if args is None or not hasattr(args, "api_key"):
        return ()  # not vLLM's app
    # vLLM: --api-key wins over VLLM_API_KEY (serve/middleware/register.py).
    keys = args.api_key or [os.environ.get("VLLM_API_KEY")]
    if isinstance(keys, str):
        keys = [keys]
    return tuple(key.encode() for key in keys if key)


def _vllm_guards(scope: Scope) -> bool:
    if scope.get("method") == "OPTIONS":
        return False
    path = scope["path"].removeprefix(scope.get("root_path", ""))
    return path.startswith(VLLM_GUARDED_PREFIXES)


def _any_matches(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    if token is None:
        return False
    matched = False
    for key in keys:  # every key, no early exit
        matched |= hmac.compare_digest(token, key)
    return matched
