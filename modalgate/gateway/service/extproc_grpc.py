"""``modalgate extproc``: Envoy's ``ExternalProcessor`` (ext_proc) on grpcio's asyncio server.

One gRPC stream per request. Its headers come first: a request that carries no body,
or whose path the gate does not judge, is decided at once (API key, method) and
continues, its body left to Envoy (``mode_override``). A judged one has its body
assembled (BUFFERED: one message; STREAMED and FULL_DUPLEX_STREAMED: chunks, up to the
gate's body cap, past which the answer is serve's 413), then decided by the gateway's
one pipeline (``extproc.judge``). Refused: an ``ImmediateResponse`` with the gate's
status, headers and OpenAI error body. Accepted: CONTINUE, with the decision's headers
set (``x-modalgate-model``, ``-rule``, ``-modalities``) and, where the gate rewrote the
body, the new body with its length.

Routing: Envoy picked the request's route when its headers arrived, on whatever the
client sent. Every answer that sets the decision's headers or drops the client's own
``x-modalgate-*`` (the header answer, judged or not, and the body answer) carries
``clear_route_cache``, so Envoy picks the route again on the gate's values; this works
under configs modalgate does not write (Envoy Gateway's ``EnvoyExtensionPolicy``)
unless they turn it off (``disable_clear_route_cache``, ``route_cache_action: RETAIN``).

The header answer waits for the decision where Envoy allows it (FULL_DUPLEX_STREAMED,
and STREAMED with ``send_body_without_waiting_for_header_response``), so nothing of
an unjudged request leaves Envoy; in BUFFERED mode Envoy holds the headers with the
body. Plain STREAMED sends the headers upstream on their answer: docs/envoy.md says
not to use it.

One message each way (``request_header_mode: SKIP``, envoy-extproc-one-message.yaml):
Envoy sends the buffered body alone, with the method and path as ``request_attributes``
and the headers the gate reads (``authorization``, ``content-type``, a tenant header)
copied into dynamic metadata by Envoy's ``header_to_metadata`` filter (namespace
``modalgate.request``, forwarded by ``metadata_options``). The answer carries the body
and the decision as dynamic metadata (namespace ``modalgate``: ``model``, ``rule``,
``modalities``), on which routes match and from which the route sets the decision's
headers; Envoy drops header mutations from a body answer there, so the client's own
``x-modalgate-*`` are removed by the config, and a ``buffer`` filter puts a rewritten
body's Content-Length back.

The generated Envoy protos come from the ``xds-protos`` wheel; health from
``grpcio-health-checking``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import uvicorn
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from modalgate.gateway.app import Gateway
from modalgate.gateway.service.authz import DECISION_HEADERS, DECISION_PREFIX
from modalgate.gateway.service.extproc import Decision, client_scope, judge

logger = logging.getLogger("modalgate.extproc")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
Mode = processing_mode_pb2.ProcessingMode
# Headers of a refusal Envoy sends the client (the rest are the gate's own business).
REFUSAL_HEADERS = frozenset(
    (b"content-type", b"x-request-id", b"retry-after", b"allow", b"www-authenticate")
)
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
MESSAGE_ROOM = 1 << 20  # a message's headers and framing beside the body
# One message each way: where the headers the gate reads come (header_to_metadata), where
# the method and path come (request_attributes), and where the decision goes.
HEADERS_NAMESPACE = "modalgate.request"
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
DECISION_NAMESPACE = "modalgate"


class ModalGateExtProc(ext_proc_grpc.ExternalProcessorServicer):
    """The servicer an operator adds to their own ``grpc.aio`` server:
    ``ext_proc_grpc.add_ExternalProcessorServicer_to_server(ModalGateExtProc(gw), server)``,
    with the gateway's lifespan run (``serve_extproc`` runs it under uvicorn)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Process(  # the generated servicer names it
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = _Exchange(self.gateway)
        async for request in request_iterator:
            for response in await exchange.step(request):
                yield response
            if exchange.finished:
                return


@dataclass
class _Exchange:
    """One request's stream: what has come, what is owed."""

    gateway: Gateway
    scope: dict | None = None
    body: bytearray = field(default_factory=bytearray)
    chunks: int = 0  # body messages not yet answered (STREAMED)
    body_mode: int = Mode.BUFFERED
    headers_owed: bool = False  # the header answer waits for the decision
    finished: bool = False
    # The client's own x-modalgate-* header names: the gate's namespace, dropped from
    # the request whatever the gate decides, so no route or model server sees them.
    spoofed: list[str] = field(default_factory=list)
    _defer: bool = False  # Envoy sends the body before the header answer

    async def step(self, request: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        which = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self.body_mode = config.request_body_mode
            early = config.send_body_without_waiting_for_header_response
            self._defer = self.body_mode == Mode.FULL_DUPLEX_STREAMED or (
                self.body_mode == Mode.STREAMED and early
            )
        if which == "request_headers":
            return await self._headers(request.request_headers)
        if which == "request_body":
            if self.scope is None:  # the headers were skipped: one message each way
                return await self._only_body(request)
            return await self._body(request.request_body)
        if which == "request_trailers":
            return [ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if which == "response_headers":
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
        if which == "response_body":
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
        return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]

    async def _headers(self, message: ext_proc.HttpHeaders) -> list[ext_proc.ProcessingResponse]:
        method, path, headers = "GET", "/", []
        for header in message.headers.headers:
            value = header.raw_value or header.value.encode("latin-1")
            key = header.key.lower()
            if key == ":method":
                method = value.decode("latin-1")
            elif key == ":path":
                path = value.decode("latin-1")
            elif key == ":authority":
                headers.append((b"host", value))
            elif not key.startswith(":"):
                name = key.encode("latin-1")
                if name.startswith(DECISION_PREFIX) and key not in self.spoofed:
                    self.spoofed.append(key)
                headers.append((name, value))
        self.scope = client_scope(method, path, headers)
        judged = self.gateway.gate.judges(method, self.scope["path"])
        if message.end_of_stream or not judged:
            decision = await judge(self.gateway.app, self.scope, b"")
            if not decision.allowed:
                return [self._refusal(decision)]
            allowing = _allowing(decision, None, self.spoofed)
            response = ext_proc.ProcessingResponse(
                request_headers=ext_proc.HeadersResponse(response=allowing)
            )
            if not message.end_of_stream:  # not judged: its body is Envoy's
                response.mode_override.request_body_mode = Mode.NONE
            self.finished = message.end_of_stream
            return [response]
        if self._defer:
            self.headers_owed = True
            return []
        # Judged once the body is here; meanwhile the client's own decision headers go
        # (in plain STREAMED mode these headers leave for the upstream on this answer).
        stripping = _stripping(self.spoofed)
        return [
            ext_proc.ProcessingResponse(
                request_headers=ext_proc.HeadersResponse(response=stripping)
            )
        ]

    async def _only_body(
        self, request: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        """The whole request in one message: its head from attributes and metadata."""
        attributes = request.attributes.get(ATTRIBUTES_NAMESPACE)
        named = attributes.fields if attributes is not None else {}
        method = named["request.method"].string_value if "request.method" in named else "POST"
        path = named["request.path"].string_value if "request.path" in named else "/"
        copied = request.metadata_context.filter_metadata.get(HEADERS_NAMESPACE)
        headers = [
            (name.lower().encode("latin-1"), value.string_value.encode("latin-1"))
            for name, value in (copied.fields.items() if copied is not None else ())
        ]
        self.scope = client_scope(method, path, headers)
        if not self.gateway.gate.judges(method, self.scope["path"]):
            self.finished = True  # a body the gate does not read: Envoy's, as it is
            return [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())]
        return await self._body(request.request_body)

    async def _body(self, message: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        assert self.scope is not None
        self.chunks += 1
        if self.chunks == 1 and message.end_of_stream:  # BUFFERED: the body, uncopied
            original = message.body
        else:
            self.body += message.body
            if len(self.body) > self.gateway.gate.read_cap:  # as it is: the gate's own 413
                return [self._refusal(await judge(self.gateway.app, self.scope, bytes(self.body)))]
            if not message.end_of_stream:
                return []
            original = bytes(self.body)
        decision = await judge(self.gateway.app, self.scope, original)
        if not decision.allowed:
            return [self._refusal(decision)]
        self.finished = True
        unchanged = decision.body is original or decision.body == original
        return self._allowed(decision, original, None if unchanged else decision.body)

    def _allowed(
        self, decision: Decision, original: bytes, rewritten: bytes | None
    ) -> list[ext_proc.ProcessingResponse]:
        responses = []
        common = _allowing(decision, rewritten, self.spoofed)
        if self.headers_owed:
            responses.append(
                ext_proc.ProcessingResponse(
                    request_headers=ext_proc.HeadersResponse(response=common)
                )
            )
            common = ext_proc.CommonResponse()
        if self.body_mode == Mode.FULL_DUPLEX_STREAMED:
            body = rewritten if rewritten is not None else original
            common.body_mutation.streamed_response.body = body
            common.body_mutation.streamed_response.end_of_stream = True
            responses.append(
                ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common))
            )
            return responses
        if self.body_mode == Mode.STREAMED:  # one answer per chunk, the new body on the last
            for _ in range(self.chunks - 1):
                each = ext_proc.CommonResponse()
                if rewritten is not None:
                    each.body_mutation.clear_body = True
                responses.append(
                    ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=each))
                )
        if rewritten is not None:
            common.body_mutation.body = rewritten
        responses.append(
            ext_proc.ProcessingResponse(
                request_body=ext_proc.BodyResponse(response=common),
                dynamic_metadata=_decision_metadata(decision),
            )
        )
        return responses

    def _refusal(self, decision: Decision) -> ext_proc.ProcessingResponse:
        self.finished = True
        immediate = ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=decision.status),
            body=decision.body,
            details="modalgate_refused",
        )
        for key, value in decision.headers:
            if key in REFUSAL_HEADERS:
                immediate.headers.set_headers.append(_set(key, value))
        return ext_proc.ProcessingResponse(immediate_response=immediate)


def _allowing(
    decision: Decision, rewritten: bytes | None, spoofed: list[str]
) -> ext_proc.CommonResponse:
    """CONTINUE, the client's own ``x-modalgate-*`` dropped and the decision's headers
    set, the route picked again on them."""
    common = _stripping(spoofed)
    for key in DECISION_HEADERS:
        value = decision.header(key)
        if value is not None:
            common.header_mutation.set_headers.append(_set(key, value))
    if rewritten is not None:
        length = str(len(rewritten)).encode("ascii")
        common.header_mutation.set_headers.append(_set(b"content-length", length))
    # Envoy chose the route on the client's headers; with this it chooses again on the
    # ones just set (it honours the flag only beside a header mutation).
    common.clear_route_cache = True
    return common


def _decision_metadata(decision: Decision) -> struct_pb2.Struct:
    """The decision as dynamic metadata (``modalgate``: ``model``, ``rule``,
    ``modalities``): what routes match on where Envoy takes no header mutation from a body
    answer (one message each way); accepted only where ``metadata_options`` lists it."""
    values = {
        key.decode("latin-1").removeprefix("x-modalgate-"): value.decode("latin-1")
        for key in DECISION_HEADERS
        if (value := decision.header(key)) is not None
    }
    metadata = struct_pb2.Struct()
    metadata.update({DECISION_NAMESPACE: values})
    return metadata


def _stripping(spoofed: list[str]) -> ext_proc.CommonResponse:
    """CONTINUE with the client's own ``x-modalgate-*`` headers removed (Envoy applies
    removals before sets, so a name set in the same answer keeps the gate's value), and
    the route chosen again without them; nothing to remove, nothing changed."""
    common = ext_proc.CommonResponse()
    if spoofed:
        common.header_mutation.remove_headers.extend(spoofed)
        common.clear_route_cache = True
    return common


def _set(key: bytes, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key.decode("latin-1"), raw_value=value),
        append_action=_OVERWRITE,
    )


async def serve_extproc(gateway: Gateway, listen: str, http_host: str, http_port: int) -> None:
    """The processor on ``listen`` (gRPC, with the health service) and the gateway's own
    HTTP routes (``/metrics``, ``/healthz``, ``/readyz``) on ``http_host:http_port``,
    until SIGTERM or SIGINT: then health says NOT_SERVING, and streams in flight get the
    gateway's grace period to finish."""
    config = uvicorn.Config(
        gateway, host=http_host, port=http_port, lifespan="on", log_config=None, access_log=False
    )
    http = uvicorn.Server(config)
    http.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # ours, below
    room = gateway.gate.read_cap + MESSAGE_ROOM  # a buffered body is one message
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", room), ("grpc.max_send_message_length", room)]
    )
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ModalGateExtProc(gateway), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)  # the gateway's lifespan has run: policy watch, warmup
    if http_task.done():
        await http_task
        raise OSError(f"cannot serve HTTP on {http_host}:{http_port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("extproc listening", extra={"fields": {"grpc": listen, "http": http_port}})
    await stop.wait()
    for service in ("", SERVICE_NAME):
        await checks.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(gateway.settings.grace_period_s)
    http.should_exit = True
    await http_task
