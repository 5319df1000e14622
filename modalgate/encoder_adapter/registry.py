"""Encoder adapters by name: built-ins, ``register()``, and the ``modalgate.encoders`` entry points.

A third-party package adds an adapter without touching modalgate:

    [project.entry-points."modalgate.encoders"]
    mypool = "mypackage.encoders:make_adapter"   # make_adapter(arg: str | None) -> EncoderAdapter

and users select it with ``modalgate serve --encoder mypool:ARG`` or ``encoder:`` in a policy rule.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from modalgate.encoder_adapter.protocol import EncoderAdapter

EncoderFactory = Callable[[str | None], EncoderAdapter]
ENTRY_POINT_GROUP = "modalgate.encoders"

# Imported on first use: torch and transformers load only when an encoder is asked for.
_BUILTIN: dict[str, str] = {
    "kimi": "modalgate.encoder_adapter.kimi.adapter:kimi_encoder",
    "qwen": "modalgate.encoder_adapter.qwen.adapter:qwen_encoder",
    "ray": "modalgate.encoder_adapter.ray.client:ray_encoder",
}
_registered: dict[str, EncoderFactory] = {}


class UnknownEncoder(LookupError):
    pass


def register(name: str, factory: EncoderFactory) -> None:
    _registered[name] = factory


def available() -> list[str]:
    names = set(_BUILTIN) | set(_registered)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def create_encoder(spec: str) -> EncoderAdapter:
    """``NAME`` or ``NAME:ARG`` (the argument is the adapter's: a directory, an app name...)."""
    name, _, arg = spec.partition(":")
    return _factory(name)(arg or None)


def _factory(name: str) -> EncoderFactory:
    if name in _registered:
        return _registered[name]
    if name in _BUILTIN:
        module, _, attribute = _BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name == name:
            factory: EncoderFactory = entry_point.load()
            return factory
    raise UnknownEncoder(f"no encoder named {name!r} (available: {', '.join(available())})")
