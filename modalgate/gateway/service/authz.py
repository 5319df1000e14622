"""Envoy's external authorisation (``ext_authz``, HTTP service) answered by the gate.

Behind Envoy, Envoy proxies and modalgate only decides. Envoy's ext_authz filter
sends each request's method, path (under ``http_service.path_prefix``), chosen
headers and whole body (``with_request_body``) to ``modalgate serve
--authz-prefix PREFIX``; the same gate as ``modalgate serve --upstream`` judges
it, and the answer is Envoy's to act on: 200 lets the request go on to the model
server (with the decision's ``x-modalgate-*`` headers set on it, for routes to match
on), anything else is sent to the client as it is, OpenAI error envelope and status
included.

The decision headers (``decision_headers``) are the same here as in ext_proc, and come
with every allow, so a client's own copies are always overwritten. Envoy picked the
request's route before the check answered; the filter's ``clear_route_cache: true``
(deploy/envoy/envoy.yaml) makes it pick again on the headers the check set.

What cannot happen here, since ext_authz carries headers but never a new body:
a fallback's ``model`` rewrite, the embeds rewrite, inlining fetched media, and
rebinding media ids. Rules with fallbacks or embeds are refused at start and on
reload (``authz_problems``); remote media are still fetched and checked when the
policy says so, but the model server downloads them again, and a part carrying a
media id is refused unless the policy lets ids ``pass`` (``authz_policy``).
docs/envoy.md has the Envoy configuration.
"""

from __future__ import annotations

from urllib.parse import quote

from starlette.types import ASGIApp, Receive, Scope, Send

from modalgate.gateway.gate.middleware import get_verdict
from modalgate.policy import Policy, RuleMatcher
from modalgate.validators import Verdict

AUTHZ_SCOPE_KEY = "modalgate.authz"  # marks a check; its path is the client's own
MODEL_HEADER = b"x-modalgate-model"  # the model the request was judged as
RULE_HEADER = b"x-modalgate-rule"  # the policy rule that judged it
MODALITIES_HEADER = b"x-modalgate-modalities"  # what the request carries: text,image,...
# What the gate sets on an allowed request, in ext_authz and ext_proc alike: routes may
# match on them, so a client's own copy must never reach a route or the model server.
DECISION_HEADERS = (MODEL_HEADER, RULE_HEADER, MODALITIES_HEADER)
# The gate's header namespace: a client's x-modalgate-* are dropped wherever the gate
# sees them (ext_proc), and by the config where it does not (ext_authz).
DECISION_PREFIX = b"x-modalgate-"
NONE = b"-"  # model's or rule's value when there is none (a GET, no rule of the policy)


class AuthzChecks:
    """The outermost router of an authz gateway: a request under ``prefix`` is a check of
    the client's request whose path follows the prefix; it goes on to the gate with that
    path and marked, so the app behind the gate allows it instead of serving it. Any
    other request (``/healthz``, ``/metrics``) is the gateway's own."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            checked = scope["path"][len(self.prefix) :]
            if not checked or checked.startswith("/"):  # /ext-authz-other is not a check
                scope = self._checked(scope, checked or "/")
        await self.app(scope, receive, send)

    def _checked(self, scope: Scope, path: str) -> Scope:
        raw = scope.get("raw_path")
        prefix = self.prefix.encode()
        if raw is not None and raw.startswith(prefix):
            raw = raw[len(prefix) :] or b"/"
        else:
            raw = path.encode("utf-8")
        return {**scope, "path": path, "raw_path": raw, AUTHZ_SCOPE_KEY: True}


class AllowChecked:
    """Behind the gate: a check that got this far passed it, so the answer is 200 with
    what the gate decided, for Envoy to set on the request it forwards. Requests the
    gate does not judge (other paths, GET) are allowed as ``modalgate serve`` would
    forward them. Unmarked requests go on to the gateway's own routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get(AUTHZ_SCOPE_KEY):
            await self.app(scope, receive, send)
            return
        # Every decision header every time, ``-`` for none: Envoy overwrites a request
        # header only when the check's answer carries it, so one left out would reach the
        # route and the model server with the client's own value (deploy/envoy/envoy.yaml
        # strips those too, and has the route picked again on these).
        headers = [(b"content-length", b"0"), *decision_headers(get_verdict(scope))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def decision_headers(verdict: Verdict | None) -> list[tuple[bytes, bytes]]:
    """The headers an allowed request carries on (``DECISION_HEADERS``, all of them):
    what ext_authz's answer sets and ext_proc's header mutation sets, the same values."""
    model, rule = judged_headers(verdict)
    return [(MODEL_HEADER, model), (RULE_HEADER, rule), (MODALITIES_HEADER, modalities(verdict))]


def modalities(verdict: Verdict | None) -> bytes:
    """``x-modalgate-modalities``: ``text`` and each media modality the request carries,
    sorted (``text``, ``text,image``, ``text,image,video``); ``text`` where nothing was
    judged."""
    present = sorted({part.modality for part in verdict.parts}) if verdict else []
    return ",".join(["text", *present]).encode("ascii")


def judged_headers(verdict: Verdict | None) -> tuple[bytes, bytes]:
    """``x-modalgate-model`` and ``x-modalgate-rule`` for a verdict, ``-`` for none."""
    model = rule = NONE
    if verdict is not None:
        judged = verdict.judged_as or verdict.model
        if judged:
            model = header_value(judged)
        if verdict.rule is not None and verdict.rule.known:
            rule = header_value(verdict.rule.name)
    return model, rule


def header_value(text: str) -> bytes:
    """``text`` as a header value Envoy passes on: the model name is the client's, so
    control characters (a CR LF would start a header of the client's choosing) and
    non-ASCII are percent-encoded; ordinary names (``moonshotai/Kimi-K3``) stay as they are."""
    return quote(text, safe=_HEADER_SAFE).encode("ascii")


_HEADER_SAFE = " !#$&'()*+,./:;=?@[]^_`{|}~-"


def authz_problems(policy: Policy, mode: str | None) -> list[str]:
    """Rules whose decision needs a new body, which Envoy's ext_authz cannot forward."""
    problems = []
    for rule in RuleMatcher(policy, mode).rules:
        if rule.fallback:
            problems.append(
                f"rule {rule.name!r}: a fallback rewrites the request's model, which Envoy's "
                "ext_authz cannot forward (use modalgate serve --upstream)"
            )
        if rule.upstream:
            problems.append(own_upstream_problem(rule.name))
        if rule.embeds is not None:
            problems.append(
                f"rule {rule.name!r}: embeds rewrite the request's images, which Envoy's "
                "ext_authz cannot forward (use modalgate serve --upstream)"
            )
    return problems


def own_upstream_problem(rule_name: str) -> str:
    """Behind Envoy (ext_authz or ext_proc), where a request goes is Envoy's routing."""
    return (
        f"rule {rule_name!r}: its own upstream is Envoy's to route to (a route on "
        "the x-modalgate-rule header), not the policy's"
    )


def authz_policy(policy: Policy) -> Policy:
    """``policy`` as a decision service applies it: fetched media are checked, not
    inlined, since the body Envoy forwards is the client's own; for the same reason a
    media id cannot be rebound, so a part with one is refused unless ids ``pass``."""
    updates: dict[str, object] = {}
    if policy.media_urls.inline_fetched:
        updates["media_urls"] = policy.media_urls.model_copy(update={"inline_fetched": False})
    if policy.media_ids.mode != "pass":
        updates["media_ids"] = policy.media_ids.model_copy(update={"mode": "refuse"})
    if any(rule.media_ids not in (None, "pass", "refuse") for rule in policy.models):
        updates["models"] = tuple(
            rule.model_copy(update={"media_ids": "refuse"})
            if rule.media_ids not in (None, "pass", "refuse")
            else rule
            for rule in policy.models
        )
    return policy.model_copy(update=updates) if updates else policy
