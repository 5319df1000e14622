"""The gateway's one decision, asked from Envoy's External Processing filter (``ext_proc``).

``modalgate extproc`` (``extproc_grpc``) turns each ext_proc stream into one in-process
request to the same ``Gateway`` app ``modalgate serve`` runs: the same policy, error
envelope, metrics, dialects and settings, so a body refused by one is refused by both
with the same code and param. The request enters marked as a check (as ext_authz's
are, ``authz.AUTHZ_SCOPE_KEY``; no HTTP request can carry the mark) and, accepted, ends
at ``ExtProcAllow``: 200, the decision's headers, and the body as the gate passed it on
(rewritten where a fallback changed its model or remote media were inlined). Anything
else the app answers (400, 401, 413, ...) is the refusal Envoy sends the client.

``judge`` is the bridge: ext_proc's method, path, headers and body in, a ``Decision``
out. Nothing here knows gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modalgate.gateway.gate.middleware import body_rewritten, get_verdict
from modalgate.gateway.gate.paths import with_normalized_path
from modalgate.gateway.service.authz import (
    AUTHZ_SCOPE_KEY,
    decision_headers,
    own_upstream_problem,
)
from modalgate.policy import Policy, RuleMatcher

DECISION_HEADER = b"x-modalgate-decision"  # ExtProcAllow's mark on its own answer
BODY_HEADER = b"x-modalgate-body"  # "rewritten": the answer's body replaces the request's


class ExtProcAllow:
    """Behind the gate, for ext_proc checks: the request got this far, so it is allowed;
    the answer carries what the gate decided and the body it passed on.

    ``body_back="rewritten"`` (the HTTP check, ``--check-prefix``): the body comes back
    only where the gate changed it, marked ``x-modalgate-body: rewritten``, so an
    unchanged megabyte is not sent back to Envoy, which still holds it."""

    def __init__(self, app: ASGIApp, body_back: Literal["always", "rewritten"] = "always") -> None:
        self.app = app
        self.body_back = body_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get(AUTHZ_SCOPE_KEY):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        # One message, nearly always (the gate replays the body whole): the very bytes
        # the gate passed on, uncopied, so ``judge``'s caller sees an unchanged body as
        # the same object.
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        headers = [(DECISION_HEADER, b"allow"), *decision_headers(get_verdict(scope))]
        if self.body_back == "rewritten":
            if body_rewritten(scope):
                headers.append((BODY_HEADER, b"rewritten"))
            else:
                body = b""
        headers.append((b"content-length", str(len(body)).encode("ascii")))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass
class Decision:
    """The app's answer to one check: allowed (with headers to set and the body as the
    gate passed it on), or the response to send the client instead."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    @property
    def allowed(self) -> bool:
        return self.status == 200 and (DECISION_HEADER, b"allow") in self.headers

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)


def client_scope(method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Scope:
    """The ASGI scope of the client's request as Envoy saw it."""
    target, _, query = path.partition("?")
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "scheme": "http",
        "method": method.upper(),
        "path": target,
        "raw_path": target.encode("latin-1", "replace"),
        "query_string": query.encode("latin-1", "replace"),
        "root_path": "",
        "headers": list(headers),
        "client": ("envoy", 0),
        "server": ("modalgate-extproc", 0),
    }
    return with_normalized_path(scope)


async def judge(app: ASGIApp, scope: Scope, body: bytes) -> Decision:
    """One request through ``app`` (the gateway), its answer collected."""
    sent_body = False
    decision = Decision(status=500)
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}  # after the body: the check is over

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            decision.status = message["status"]
            decision.headers = [(k.lower(), v) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app({**scope, AUTHZ_SCOPE_KEY: True}, receive, send)
    decision.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return decision


def extproc_problems(policy: Policy, mode: str | None) -> list[str]:
    """Rules whose decision ext_proc cannot carry out here."""
    problems = []
    for rule in RuleMatcher(policy, mode).rules:
        if rule.upstream:
            problems.append(own_upstream_problem(rule.name))
        if rule.embeds is not None:
            problems.append(
                f"rule {rule.name!r}: embeds rewrites call the encoder on the way to the model"
                " server, which modalgate extproc does not do (use modalgate serve --upstream)"
            )
    return problems
