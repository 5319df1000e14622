"""``/readyz`` names each upstream and why it is not ready: real gateways in front of the toy
upstream, a closed port, a server that never answers, and servers that answer wrongly."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import anyio
import httpx
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from conftest import free_port, serve
from gateway_proc import GatewayProcess
from modalgate.gateway.service.catalog import ModelCatalog
from modalgate.gateway.service.health import Readiness
from modalgate.gateway.upstream.balancer import Target, Upstreams
from modalgate.gateway.upstream.proxy import UpstreamSettings
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.policy.models import ModelRule, UpstreamTarget
from toy_upstream import ToyUpstream


@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[ToyUpstream, str]]:
    upstream = ToyUpstream()
    with serve(upstream.app()) as base:
        yield upstream, base


def html_everywhere() -> Starlette:
    """A web server that answers 200 to anything, as a UI behind a wrong URL would."""

    async def page(request):
        return PlainTextResponse("<html>hello</html>")

    return Starlette(routes=[Route("/{path:path}", page)])


def ready(gateway: GatewayProcess) -> httpx.Response:
    return httpx.get(gateway.url + "/readyz", timeout=10)


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_a_good_upstream_is_ready_with_or_without_v1(toy, suffix):
    _, base = toy
    with GatewayProcess("--upstream", base + suffix) as gateway:
        answer = ready(gateway)
        assert answer.status_code == 200
        assert answer.json() == {
            "status": "ready",
            "checks": {"policy": True, "upstream": True, "encoders": True},
            "upstreams": {base: {"ready": True}},
        }


def test_each_reason_is_named(toy, tmp_path):
    _, base = toy
    closed = f"http://127.0.0.1:{free_port()}"
    with (
        socket.create_server(("127.0.0.1", 0)) as silent,  # takes connections, never answers
        serve(html_everywhere()) as html,
    ):
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        policy = {
            "refused": closed,
            "prefixed": base + "/llm/v1",  # a prefix the toy does not serve: its 404
            "silent": silent_url,
            "html": html,
            "fine": base,
        }
        rules = "".join(
            f"  - {{name: {name}, accepts: [image], upstream: '{url}'}}\n"
            for name, url in policy.items()
        )
        policy_file = tmp_path / "policy.yaml"
        policy_file.write_text("extends: builtin\nmodels:\n" + rules, encoding="utf-8")
        with GatewayProcess("--policy", str(policy_file)) as gateway:
            answer = ready(gateway)
    assert answer.status_code == 503
    body = answer.json()
    assert body["status"] == "not_ready"
    assert body["checks"] == {
        "policy": True,
        "upstream": False,
        "encoders": True,
        "routes": {
            "refused": False,
            "prefixed": False,
            "silent": False,
            "html": False,
            "fine": True,
        },
    }
    assert body["upstreams"] == {
        closed: {"ready": False, "reason": "connection refused"},
        base + "/llm": {"ready": False, "reason": "status 404 from /v1/models"},
        silent_url: {"ready": False, "reason": "timeout: no answer from /v1/models within 2 s"},
        html: {"ready": False, "reason": "status 200 from /v1/models, but not a model list"},
        base: {"ready": True},
    }


def test_a_down_default_upstream_says_connection_refused():
    closed = f"http://127.0.0.1:{free_port()}"
    with GatewayProcess("--upstream", closed + "/v1") as gateway:
        answer = ready(gateway)
    assert answer.status_code == 503
    assert answer.json()["upstreams"] == {closed: {"ready": False, "reason": "connection refused"}}


def test_a_validation_service_is_ready_without_upstreams():
    with GatewayProcess() as gateway:
        answer = ready(gateway)
    assert (answer.status_code, answer.json()) == (
        200,
        {"status": "ready", "checks": {"policy": True, "upstream": True, "encoders": True}},
    )


def test_polls_that_arrive_together_cost_one_probe(toy):
    upstream, base = toy

    async def poll_together() -> None:
        upstreams = Upstreams(base, UpstreamSettings(), "/health")
        readiness = Readiness(upstreams)
        try:
            async with anyio.create_task_group() as group:
                for _ in range(50):
                    group.start_soon(readiness.upstream_states)
        finally:
            await upstreams.aclose()

    upstream.received.clear()
    anyio.run(poll_together)
    assert [r.path for r in upstream.received] == ["/v1/models"]


def test_a_reload_while_the_probes_run_is_answered_not_a_500(toy):
    # The routes are read once, with the targets probed: a new upstream that a reload adds
    # during the probes is not looked up in states that never had it (was a KeyError).
    _, base = toy
    added = f"http://127.0.0.1:{free_port()}"

    class ReloadedMidProbe(Readiness):
        async def _probe(self, target):
            await super()._probe(target)
            rule = ModelRule(name="added", accepts=[], upstream=[UpstreamTarget(url=added)])
            self.upstreams.use_policy([rule])

    async def poll() -> tuple[int, dict]:
        upstreams = Upstreams(base, UpstreamSettings(), "/health")
        try:
            readiness = ReloadedMidProbe(upstreams)
            readiness.encoders_warm = True  # as the app sets it without encoders
            answer = await readiness.endpoint(None)
            return answer.status_code, orjson.loads(answer.body)
        finally:
            await upstreams.aclose()

    status, body = anyio.run(poll)
    assert status == 200  # as it stood when the poll began: the default route, ready
    assert body["checks"] == {"policy": True, "upstream": True, "encoders": True}
    assert body["upstreams"] == {base: {"ready": True}}


def test_the_health_watch_reads_the_model_list_of_an_upstream_back_up():
    # Down at start, nothing read; the watch's first probe that finds it answering reads
    # its /v1/models, so the gate knows what it serves without a readiness poll.
    port = free_port()
    toy = ToyUpstream(name="kimi-k3", owned_by="vllm")
    server = uvicorn.Server(uvicorn.Config(toy.app(), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    states = []

    async def down_then_up() -> Target:
        upstreams = Upstreams(f"http://127.0.0.1:{port}", UpstreamSettings(), "/health")
        policy = parse_policy("extends: builtin\n", fmt="yaml")
        ModelCatalog(lambda: RuleMatcher(policy), upstreams)
        (target,) = upstreams.targets.values()
        try:
            await upstreams.probe()
            states.append((target.healthy, target.listed, target.engine))
            thread.start()
            deadline = time.monotonic() + 10
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline
                await anyio.sleep(0.01)
            await upstreams.probe()
            return target
        finally:
            await upstreams.aclose()

    try:
        target = anyio.run(down_then_up)
    finally:
        server.should_exit = True
        if thread.is_alive():
            thread.join(10)
    assert states == [(False, False, None)]
    assert (target.healthy, target.listed, target.engine) == (True, True, "vllm")
    assert target.served == ("kimi-k3",)
    assert [r.path for r in toy.received] == ["/v1/models"]  # (the toy records no /health)
