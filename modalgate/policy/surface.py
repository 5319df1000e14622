"""The engines' API surface as data: every door each engine registers (``doors.yaml``),
how the gate reads its body, and the default surface a gateway serves.

With no engine named, the gate serves the union of the engines' doors, bar their admin
paths: any engine's media door is judged, whichever engine is behind. Where one is
named, that engine's own table applies (``doors_for``).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, TypeAdapter

# How the gate reads a path's body: each judged kind has its reader in validators/.
JudgedKind = Literal[
    "chat",
    "responses",
    "completions",
    "messages",
    "generate",
    "anthropic",
    "chat_batch",
    "score",
    "embed_v2",
    "pooling",
    "token_in",
    "invocations",
    "vertex",
    "media_lists",
    "ollama",
    "audio_upload",
]
# ``forward``: no media, passed on unread; ``admin``: an engine's control path, never
# forwarded by the proxy; ``refuse``: media in a shape the gate does not read, refused;
# ``realtime``: the realtime websocket, its events judged as they come.
EndpointKind = Literal[JudgedKind, "forward", "admin", "refuse", "realtime"]
UNJUDGED: frozenset[str] = frozenset({"forward", "admin", "refuse", "realtime"})
# Kinds a proxy never forwards.
CLOSED: frozenset[str] = frozenset({"admin", "refuse"})
Engine = Literal["vllm", "sglang", "openai"]


class Endpoint(BaseModel):
    """A door whose body is taken on more methods than POST (SGLang's ``PUT /generate``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: EndpointKind
    methods: tuple[str, ...] = ("POST",)


EndpointSpec = EndpointKind | Endpoint
_TABLES = TypeAdapter(dict[Engine, dict[str, EndpointSpec]])


@cache
def engine_doors() -> dict[str, dict[str, EndpointSpec]]:
    """Each engine's doors, as ``doors.yaml`` lists them."""
    text = resources.files("modalgate.policy").joinpath("doors.yaml").read_text("utf-8")
    return _TABLES.validate_python(yaml.safe_load(text))


def kind_of(spec: EndpointSpec) -> EndpointKind:
    return spec.kind if isinstance(spec, Endpoint) else spec


def default_endpoints() -> dict[str, EndpointSpec]:
    """The union of every engine's doors, admin paths left out (a proxy forwards what is
    listed). Where engines read a path differently, the gate reads it every way
    (``invocations``: every reading whose keys the body has), a judged reading wins over
    none, a refusal over a pass; with the methods of every engine."""
    union: dict[str, EndpointSpec] = {}
    for table in engine_doors().values():
        for path, spec in table.items():
            if kind_of(spec) == "admin":
                continue
            union[path] = _merged(union.get(path), spec)
    return union


def _merged(have: EndpointSpec | None, new: EndpointSpec) -> EndpointSpec:
    if have is None:
        return new
    kind, other = kind_of(have), kind_of(new)
    if kind != other:
        if kind not in UNJUDGED and other not in UNJUDGED:
            kind = "invocations"
        elif kind in UNJUDGED and (other not in UNJUDGED or other == "refuse"):
            kind = other
    methods = sorted({*_methods(have), *_methods(new)})
    return kind if methods == ["POST"] else Endpoint(kind=kind, methods=tuple(methods))


def _methods(spec: EndpointSpec) -> tuple[str, ...]:
    return spec.methods if isinstance(spec, Endpoint) else ("POST",)


def doors_for(engine: str | None, listed: dict[str, EndpointSpec]) -> dict[str, EndpointSpec]:
    """The surface for a gate in front of ``engine``: its doors, then the policy's own
    ``listed`` paths over them. No engine: ``listed`` alone."""
    if engine is None:
        return listed
    return {**engine_doors()[engine], **listed}
