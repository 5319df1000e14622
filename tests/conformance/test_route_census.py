"""The census: every door vLLM and SGLang register is classified in the gate's table of
doors (``modalgate/policy/doors.yaml``), and nothing is listed that the engine does not
register. A release that adds a door fails here until the door is classified.

Reads the engines' source in ``.venv-conformance`` (``bash tests/conformance/install.sh``).
"""

from __future__ import annotations

import pytest

from conformance.differential import ENGINE_PYTHON
from conformance.routes import Route, routes_in
from modalgate.policy.endpoints import EndpointTable
from modalgate.policy.surface import UNJUDGED, engine_doors

SITE = ENGINE_PYTHON.parents[1] / "lib" / "python3.11" / "site-packages"
# Where each engine registers its API server's routes.
SOURCES = {"vllm": ("vllm/entrypoints",), "sglang": ("sglang/srt/entrypoints",)}
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

pytestmark = pytest.mark.skipif(
    not SITE.exists(), reason=f"{SITE} is missing: run bash tests/conformance/install.sh"
)


def registered(engine: str) -> list[Route]:
    return [
        route
        for source in SOURCES[engine]
        for route in routes_in(SITE / source, source.split("/")[0])
    ]


def _templated(path: str) -> str:
    """``/v1/responses/{response_id}`` -> ``/v1/responses/x``: matched as a concrete path."""
    return "/".join("x" if part.startswith("{") else part for part in path.split("/"))


@pytest.mark.parametrize("engine", sorted(SOURCES))
def test_every_registered_door_is_classified(engine):
    table = EndpointTable(engine_doors()[engine])
    unclassified = sorted(
        f"{'/'.join(sorted(r.methods))} {r.path} ({r.where})"
        for r in registered(engine)
        if table.kind_of(_templated(r.path)) is None
    )
    assert not unclassified, f"{engine} doors nobody classified:\n" + "\n".join(unclassified)


@pytest.mark.parametrize("engine", sorted(SOURCES))
def test_every_listed_door_is_registered(engine):
    paths = {_templated(r.path) for r in registered(engine)}
    stale = [
        listed
        for listed in engine_doors()[engine]
        if not (
            listed in paths
            or (listed.endswith("/*") and any(p.startswith(listed[:-1]) for p in paths))
        )
    ]
    assert not stale, f"{engine}: listed but not registered: {stale}"


@pytest.mark.parametrize("engine", sorted(SOURCES))
def test_every_method_that_carries_a_body_is_judged(engine):
    """A judged door is judged on every method the engine takes its body on (SGLang's
    PUT /generate), and a websocket door is guarded as realtime audio or refused."""
    table = EndpointTable(engine_doors()[engine])
    wrong = []
    for route in registered(engine):
        path = _templated(route.path)
        kind = table.kind_of(path)
        if "WEBSOCKET" in route.methods:
            if kind not in ("realtime", "refuse"):
                wrong.append(f"websocket {route.path}: {kind}")
            continue
        if kind in UNJUDGED:
            continue
        missing = route.methods & BODY_METHODS - table.body_methods(path)
        if missing:
            wrong.append(f"{route.path}: {sorted(missing)} not judged ({route.where})")
    assert not wrong, "\n".join(wrong)


def test_the_census_reads_what_it_should():
    """The reader is held to doors known to be there: a reader that found nothing would
    pass the census vacuously."""
    vllm = {(r.path, m) for r in registered("vllm") for m in r.methods}
    sglang = {(r.path, m) for r in registered("sglang") for m in r.methods}
    assert {("/v1/messages", "POST"), ("/v1/realtime", "WEBSOCKET"), ("/v2/embed", "POST")} <= vllm
    assert {("/generate", "PUT"), ("/vertex_generate", "POST"), ("/api/chat", "POST")} <= sglang
    assert len(vllm) > 70 and len(sglang) > 90
