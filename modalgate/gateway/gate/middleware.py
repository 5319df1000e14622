"""``ModalGate``: pure ASGI middleware that refuses bad multimodal requests at the door.

The path is normalised first (and passed on normalised), so no spelling of a
gated path slips by. POST bodies on the gated paths (the chat and Responses
paths given here, and the policy's ``endpoints`` that read a body) go through the
one decision (``pipeline.Decider``); a body sent there with another method is
refused (405). Everything else (other paths, websockets, lifespan) goes straight
to the app, so streaming and upgrades work exactly as without the gate. An
accepted body is replayed to the app (as received, or as a rewrite changed it),
then the app's ``receive`` continues with the real channel, so
``http.disconnect`` still arrives when the client goes away.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from os import PathLike
from typing import Any, TypeVar

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modalgate.errors import Violation, payload_too_large
from modalgate.gateway.gate.auth import CHALLENGE, MISSING, WRONG
from modalgate.gateway.gate.cpu_threads import CpuThreads
from modalgate.gateway.gate.door_checks import (
    POST_ONLY,
    Route,
    closed_door,
    has_body,
    header_refusal,
    last_header,
    method_not_allowed,
    not_a_door,
)
from modalgate.gateway.gate.media_ids import MediaIdentity
from modalgate.gateway.gate.mounted import FROM_ENV, KeyLock, MountSettings, as_policy
from modalgate.gateway.gate.outcome import GateOutcome, OutcomeObserver
from modalgate.gateway.gate.paths import is_normal, with_normalized_path
from modalgate.gateway.gate.pipeline import Decider
from modalgate.gateway.gate.realtime import (
    POLICY_VIOLATION,
    guard_realtime,
    realtime_handshake_refusal,
)
from modalgate.gateway.gate.remote_media import MediaStage
from modalgate.gateway.gate.send import send_error
from modalgate.gateway.gate.shadow import SHADOW_HEADER, shadow_header
from modalgate.media.inline_work import InlineWorkExceeded, run_within
from modalgate.policy import Policy, RuleMatcher
from modalgate.policy.endpoints import EndpointTable
from modalgate.policy.surface import UNJUDGED, doors_for
from modalgate.validators import Verdict, validate_body
from modalgate.validators.dialects import Dialect
from modalgate.validators.request import Api, DialectOf, ServedModel
from modalgate.validators.verdict import request_unparsed
from modalgate.validators.verdict_cache import VerdictCache

DEFAULT_PATHS = ("/v1/chat/completions", "/chat/completions")
# The Responses API (vLLM and SGLang serve it too): the same checks on its ``input``.
DEFAULT_RESPONSES_PATHS = ("/v1/responses", "/responses")
# Bodies above this are validated in a worker thread: base64 and header work on
# a multi-megabyte body would otherwise stall every other request on the loop.
THREAD_THRESHOLD_BYTES = 256 * 1024
# Where the policy decodes images fully (verify_image_data: ~10-60 ms per megapixel), any
# body that can hold an image goes to a thread.
VERIFY_THREAD_THRESHOLD_BYTES = 4 * 1024
# The walk costs per value it reads (a message, a content part: up to ~10 us for a media
# part), not per byte: a small body of many values goes to a thread too. Values in arrays
# and objects are separated by commas, so a body of at most this many, or of at most
# INLINE_ANY_SHAPE_BYTES (where the count would cost more than it saves), stays inline.
INLINE_MAX_COMMAS = 256
INLINE_ANY_SHAPE_BYTES = 1024
# A PNG in a data URL starts so (its signature in base64); a JSON escape (``\u0069``)
# could spell it otherwise, so a body with a backslash is treated alike.
_MAY_HOLD_PNG = b"iVBORw0KGg"
VERDICT_STATE_KEY = "modalgate_verdict"
REWRITTEN_STATE_KEY = "modalgate_body_rewritten"  # set where the app gets another body
ROUTED_TO_HEADER = b"x-modalgate-routed-to"  # set when a fallback chose another model
T = TypeVar("T")


def _may_hold_av(body: bytes) -> bool:
    """Every video or audio part's type or key names it (``video_url``, ``input_audio``):
    FFmpeg probes it, never cheap enough for the loop (``inline_work.charge_all``)."""
    return b"video" in body or b"audio" in body


class ModalGate:
    def __init__(
        self,
        app: ASGIApp,
        policy: Policy | str | PathLike[str] | None = FROM_ENV,
        mode: str | None = FROM_ENV,
        paths: Iterable[str] = DEFAULT_PATHS,
        validation_threads: int = 4,
        on_outcome: OutcomeObserver | None = None,
        responses_paths: Iterable[str] = DEFAULT_RESPONSES_PATHS,
        served_model: str | ServedModel | None = FROM_ENV,
        enforce: bool | None = FROM_ENV,
        enforced_paths: Iterable[str] = (),
        dialect: Dialect | DialectOf | None = FROM_ENV,
        engine: str | None = FROM_ENV,
        api_keys: Iterable[str] = FROM_ENV,
    ) -> None:
        """Each argument left out is taken from the ``MODALGATE_*`` variables ``modalgate
        serve`` reads (``mounted.py``), so ``ModalGate(app)`` alone, as vLLM's
        ``--middleware`` mounts it, is configured like the gateway. ``policy=None``: the
        built-in table.

        ``served_model``: the model the app behind serves, whatever name a request
        carries (a server of one model ignores the name); or a callable that tells it
        per request. Requests are then judged as that model.

        ``enforce``: shadow mode (``shadow.py``): None as the policy says, False for every
        rule, True never; never on ``enforced_paths`` (where the verdict is the answer).

        ``dialect``: how the app behind reads content parts (``validators/dialects.py``),
        or a callable that tells it per resolved rule; None: an OpenAI-compatible server,
        unless a rule names its ``engine``.

        ``engine``: the engine behind (``vllm``, ``sglang``, ``openai``): its own doors
        (policy/doors.yaml, with the policy's listed ``endpoints`` over them) are the
        surface, and a body sent anywhere else is refused. None: the policy's
        ``endpoints`` are judged and any other path passes untouched.

        ``api_keys``: bearer keys a request must carry before its body is read (401
        ``invalid_api_key``); mounted in vLLM, vLLM's own keys are honoured too."""
        given = MountSettings(policy, mode, served_model, enforce, dialect, engine, api_keys)
        policy, mode, served_model, enforce, dialect, engine, api_keys = given.completed()
        self.lock = KeyLock(api_keys)
        self.app = app
        self.engine = engine
        self.on_outcome = on_outcome
        self.served: ServedModel | None = (
            (lambda _name, _rule: served_model) if isinstance(served_model, str) else served_model
        )
        self.paths = frozenset(p.rstrip("/") or "/" for p in paths)
        self.responses_paths = frozenset(p.rstrip("/") or "/" for p in responses_paths)
        # The paths given here win; the policy's ``endpoints`` gate the engines' other doors.
        self._given: dict[str, Api] = {
            **dict.fromkeys(self.responses_paths, "responses"),
            **dict.fromkeys(self.paths, "chat"),
        }
        self.validation_threads = validation_threads
        self._threads: CpuThreads | None = None
        self.enforce = enforce
        self.dialect: DialectOf | None = (
            (lambda _rule: dialect) if isinstance(dialect, Dialect) else dialect
        )
        self.enforced_paths = frozenset(p.rstrip("/") for p in enforced_paths)
        # The given paths already in normal form, each with its API, whether it is
        # enforced, and its raw_path: a request spelled so (nearly all) is routed by one
        # lookup and one comparison.
        self._routes: dict[str, Route] = {
            where: (api, where.rstrip("/") in self.enforced_paths, where.encode("ascii"), POST_ONLY)
            for where, api in self._given.items()
            if is_normal(where)
        }
        self.identity: MediaIdentity | None = None
        # Media judged before, by their bytes (validators/verdict_cache.py): it outlives a
        # policy swap, its keys holding the limits that judged each entry.
        self.verdict_cache = VerdictCache()
        self.set_policy(as_policy(policy), mode)

    def set_policy(self, policy: Policy, mode: str | None = None) -> None:
        """Swap the policy atomically: a request in flight keeps the matcher it started with."""
        self.matcher = RuleMatcher(policy, mode)
        verifies = policy.limits.verify_image_data or any(
            rule.limits is not None and rule.limits.verify_image_data for rule in self.matcher.rules
        )
        self.thread_threshold = (
            VERIFY_THREAD_THRESHOLD_BYTES if verifies else THREAD_THRESHOLD_BYTES
        )
        listed = policy.endpoints if "endpoints" in policy.model_fields_set else {}
        surface = doors_for(self.engine, listed) if self.engine else policy.endpoints
        self.endpoints = EndpointTable(surface)
        self.media = MediaStage(policy.media_urls)
        # The memory of media ids outlives a policy swap, as the engine's caches do.
        self.identity = (
            self.identity.with_settings(policy.media_ids)
            if self.identity is not None
            else MediaIdentity(policy.media_ids)
        )
        remembered = policy.verdict_cache
        self.verdict_cache.resize(
            remembered.max_entries if remembered.enabled else 0,
            remembered.max_bytes,
            remembered.min_payload_bytes,
        )
        # One object per policy: a request in flight keeps the one it started with.
        self.decider = Decider(
            self.matcher,
            self.media,
            self.served,
            self.run_cpu,
            self.enforce,
            self.dialect,
            inline_below=self.thread_threshold,
            identity=self.identity,
            cache=self.verdict_cache if remembered.enabled else None,
        )
        self.strict_decider = replace(self.decider, enforce=True)
        # For a small body of many values: every step in the threads, whatever its size.
        self.threaded_decider = replace(self.decider, run_cpu=self.run_in_threads)
        self.strict_threaded_decider = replace(self.threaded_decider, enforce=True)
        self.read_cap = read_cap = max(
            [policy.limits.max_body_bytes]
            + [
                r.limits.max_body_bytes
                for r in policy.models
                if r.limits and r.limits.max_body_bytes
            ]
        )
        # A Content-Length of at most this many digits is under the cap, unread.
        self._short_lengths = len(str(read_cap)) - 1

    @property
    def policy(self) -> Policy:
        return self.matcher.policy

    @property
    def mode(self) -> str | None:
        return self.matcher.mode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                send = self._closing_on_shutdown(send)
            elif scope["type"] == "websocket":
                scope = with_normalized_path(scope)
                kind = self.endpoints.kind_of(scope["path"])
                if kind == "refuse":
                    await send({"type": "websocket.close", "code": POLICY_VIOLATION})
                    return
                if kind == "realtime":
                    await guard_realtime(self.app, scope, receive, send, self.matcher, self.engine)
                    return
            await self.app(scope, receive, send)
            return
        route = self._routes.get(scope["path"])
        # A raw_path that is the path itself (or none): nothing to normalise.
        if route is None or scope.get("raw_path", route[2]) != route[2]:
            scope, route = self._routed(scope)  # any other spelling, or path, goes this way
            if route is None:
                await self.app(scope, receive, send)
                return
            if isinstance(route, Violation):
                self.report_early_refusal(scope["path"], route)
                await send_error(send, [route])
                return
        if scope["method"] not in route[3]:
            if has_body(scope):
                # A body on another method would reach a server that reads it (SGLang takes
                # PUT /generate) without being judged.
                refusal = method_not_allowed(route[3])
                self.report_early_refusal(scope["path"], refusal)
                allow = ", ".join(sorted(route[3])).encode()
                await send_error(send, [refusal], [(b"allow", allow)], route[0])
            else:
                await self.app(scope, receive, send)  # GET, HEAD, OPTIONS (CORS preflight)
            return
        # A gated POST, all in this one coroutine (each await level costs ~1,000
        # instructions): an accepted body with nothing to fetch or rewrite (nearly all) is
        # validated inline where small and forwarded with no other await of the gate's.
        api, strict, _, _ = route
        decider = self.strict_decider if strict else self.decider
        started = time.perf_counter() if self.on_outcome is not None else None
        # Keys: the gate's own, or an engine app's (mounted in vLLM: ``scope["app"]``).
        if self.lock.keys or "app" in scope:
            locked = self.lock.refuses(scope)
            if locked is not None:
                refusal = WRONG if locked else MISSING
                self.report_early_refusal(scope["path"], refusal, started=started)
                await send_error(send, [refusal], CHALLENGE, api)
                return
        read_cap = self.read_cap
        form = api == "audio_upload"
        refusal = header_refusal(scope["headers"], read_cap, self._short_lengths, form)
        if refusal is not None:
            self.report_early_refusal(scope["path"], refusal, started=started)
            await send_error(send, [refusal], api=api)
            return
        message = await receive()
        body = message.get("body", b"")
        if message.get("more_body", False) or message["type"] != "http.request":
            body = await self._rest_of_body(message, receive, send, read_cap, scope, started, api)
            if body is None:
                return
            message = {"type": "http.request", "body": body, "more_body": False}
        elif len(body) > read_cap:
            await self._too_large(send, read_cap, len(body), scope, started, api)
            return
        verdict = None
        if form:  # judged with its boundary, off the loop: an audio probe is never cheap
            decider = self.strict_threaded_decider if strict else self.threaded_decider
            content_type = last_header(scope["headers"], b"content-type")
            await self._decide(
                scope, receive, send, api, decider, body, None, started, content_type
            )
            return
        if len(body) < decider.inline_below:
            if len(body) > INLINE_ANY_SHAPE_BYTES and body.count(b",") > INLINE_MAX_COMMAS:
                decider = self.strict_threaded_decider if strict else self.threaded_decider
            elif _MAY_HOLD_PNG in body or b"\\" in body or _may_hold_av(body):
                # A PNG's pixel data is inflated: its cost is its declared size, not the
                # body's (``inline_work``); too much of it and the body goes to a thread,
                # as any video or audio probe does.
                verdict = run_within(
                    validate_body,
                    body,
                    decider.matcher,
                    api,
                    decider.served,
                    decider.dialect,
                    None,
                    decider.cache,
                )
                if isinstance(verdict, InlineWorkExceeded):
                    verdict = None
                    decider = self.strict_threaded_decider if strict else self.threaded_decider
            else:
                verdict = validate_body(
                    body, decider.matcher, api, decider.served, decider.dialect, None, decider.cache
                )
            if verdict is not None and not verdict.violations and not verdict.parts:  # text only
                if self.on_outcome is not None:
                    self._report(decider, verdict, len(body), scope["path"], started)
                scope.setdefault("state", {})[VERDICT_STATE_KEY] = verdict
                # The body in one message: the very one received, where it came in one.
                await self.app(scope, partial(_replay, [message], receive), send)
                return
        await self._decide(scope, receive, send, api, decider, body, verdict, started)

    def _routed(self, scope: Scope) -> tuple[Scope, Route | Violation | None]:
        """The scope with its path normalised, and how that path is gated (its API, whether
        it is enforced, the methods its body is taken on); None: not gated here; a
        Violation: refused whatever its body."""
        scope = with_normalized_path(scope)
        path = scope["path"]
        api = self._given.get(path)
        if api is None:
            where = path.rstrip("/") or "/"
            api = self._given.get(where)
        if api is None:
            kind = self.endpoints.kind_of(path)
            if kind == "refuse":
                return scope, closed_door(path)
            if kind == "realtime":  # the upgrade as Envoy's ext_authz and ext_proc see it
                return scope, realtime_handshake_refusal(scope, self.matcher, self.engine)
            if kind is None and self.engine is not None and has_body(scope):
                return scope, not_a_door(path, self.engine)
            if kind is None or kind in UNJUDGED:
                return scope, None
            api = kind
            methods = self.endpoints.body_methods(path)
        else:
            methods = POST_ONLY
        strict = bool(self.enforced_paths) and path.rstrip("/") in self.enforced_paths
        return scope, (api, strict, None, methods)

    async def _decide(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        api: Api,
        decider: Decider,
        body: bytes,
        verdict: Verdict | None,
        started: float | None,
        content_type: bytes | None = None,
    ) -> None:
        """The rest of the decision (``pipeline.Decider``), then the app or the error."""
        received = len(body)
        decision = await decider.decide(body, api, verdict, content_type, scope["headers"])
        verdict = decision.verdict
        if verdict.routed_from is not None:
            send = _with_header(send, ROUTED_TO_HEADER, (verdict.model or "").encode())
        if decision.shadowed:
            send = _with_header(send, SHADOW_HEADER, shadow_header(verdict.violations))
        rewritten = decision.body is not body
        if rewritten:
            body = decision.body
            scope = dict(scope, headers=with_content_length(scope, len(body)))
        if self.on_outcome is not None:
            self._report(decider, verdict, received, scope["path"], started, decision.shadowed)
        if not decision.forwards:
            await send_error(send, verdict.violations, api=api)
            return
        state = scope.setdefault("state", {})
        state[VERDICT_STATE_KEY] = verdict
        if rewritten:
            state[REWRITTEN_STATE_KEY] = True
        replayed = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, partial(_replay, [replayed], receive), send)

    def _report(
        self,
        decider: Decider,
        verdict: Verdict,
        body_bytes: int,
        path: str,
        started: float | None,
        shadowed: bool = False,
    ) -> None:
        assert self.on_outcome is not None
        rule = verdict.rule
        self.on_outcome(
            GateOutcome(
                accepted=verdict.accepted,
                violations=tuple(verdict.violations),
                model=verdict.model,
                mode=decider.matcher.mode,
                rule=rule.name if rule is not None and rule.known else None,
                routed_from=verdict.routed_from,
                shadowed=shadowed,
                body_bytes=body_bytes,
                seconds=time.perf_counter() - started if started is not None else 0.0,
                path=path,
            )
        )

    async def _rest_of_body(
        self,
        message: Message,
        receive: Receive,
        send: Send,
        read_cap: int,
        scope: Scope,
        started: float | None,
        api: Api,
    ) -> bytes | None:
        """The whole body from its first ``message`` on, or None once a 413 is sent or
        the client has gone."""
        chunks: list[bytes] = []
        size = 0
        while True:
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > read_cap:
                await self._too_large(send, read_cap, size, scope, started, api)
                return None
            if not message.get("more_body", False):
                # A body in one message (most small ones) is passed on as that very object.
                return b"".join((*chunks, chunk)) if chunks else chunk
            chunks.append(chunk)
            message = await receive()

    async def _too_large(
        self, send: Send, read_cap: int, size: int, scope: Scope, started: float | None, api: Api
    ) -> None:
        refusal = payload_too_large(read_cap)
        self.report_early_refusal(scope["path"], refusal, size, started)
        await send_error(send, [refusal], api=api)

    def judges(self, method: str, path: str) -> bool:
        """Whether a request with ``method`` on ``path`` (normalised) has its body judged
        (SGLang's PUT doors too)."""
        if self.api_of(path) is None:
            return False
        where = path.rstrip("/") or "/"
        methods = POST_ONLY if where in self._given else self.endpoints.body_methods(where)
        return method.upper() in methods

    def api_of(self, path: str) -> Api | None:
        """How a (normalised) path's body is read; None: not gated here."""
        where = path.rstrip("/") or "/"
        if where in self._given:
            return self._given[where]
        kind = self.endpoints.kind_of(where)
        return None if kind is None or kind in UNJUDGED else kind

    def report_early_refusal(
        self, path: str, violation: Violation, body_bytes: int = 0, started: float | None = None
    ) -> None:
        """Tell the observer about a refusal made before any verdict."""
        if self.on_outcome is not None:
            seconds = time.perf_counter() - started if started is not None else 0.0
            self.on_outcome(
                GateOutcome.early_refusal(violation, self.mode, path, body_bytes, seconds)
            )

    def _closing_on_shutdown(self, send: Send) -> Send:
        """Close the fetcher's connections when the app reports its shutdown done."""

        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.media.aclose()
            await send(message)

        return wrapped

    async def run_cpu(self, size: int, function: Callable[..., T], *args: object) -> T:
        """Small work inline; big work in one of the gate's own threads (``cpu_threads``)."""
        if size < self.thread_threshold:
            result = run_within(function, *args)
            if not isinstance(result, InlineWorkExceeded):
                return result
        return await self.run_in_threads(size, function, *args)

    async def run_in_threads(self, size: int, function: Callable[..., T], *args: object) -> T:
        """Work in one of the gate's own threads, whatever its size."""
        if self._threads is None:
            self._threads = CpuThreads(self.validation_threads)
        return await self._threads.run(function, *args)


def get_verdict(scope: Scope) -> Verdict | None:
    """The Verdict ModalGate attached to an accepted request (``request.state`` in Starlette)."""
    return scope.get("state", {}).get(VERDICT_STATE_KEY)


def body_rewritten(scope: Scope) -> bool:
    """Whether the app behind the gate got a body the gate changed (a fallback's model,
    inlined media, bound ids), not the client's."""
    return bool(scope.get("state", {}).get(REWRITTEN_STATE_KEY))


async def parsed_request(verdict: Verdict) -> dict[str, Any] | None:
    """``verdict.request``, read from the event loop: where validation left it unparsed
    (a big body read with its payloads aside), it is parsed in a worker thread, as the
    body's validation was."""
    if request_unparsed(verdict):
        return await anyio.to_thread.run_sync(lambda: verdict.request)
    return verdict.request


def _with_header(send: Send, name: bytes, value: bytes) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (name, value)]}
        await send(message)

    return wrapped


async def _replay(pending: list[Message], receive: Receive) -> Message:
    """The app's ``receive`` (bound with ``partial``: cheaper than a closure): the body's
    message, once, then the real channel (``http.disconnect``)."""
    if pending:
        return pending.pop()
    return await receive()


def with_content_length(scope: Scope, length: int) -> list[tuple[bytes, bytes]]:
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return headers
