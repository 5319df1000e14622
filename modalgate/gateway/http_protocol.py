"""uvicorn's httptools protocol, with a request body handed over whole and a response's
head and body sent in one write.

A body of a declared length up to ``WHOLE_BODY_BYTES`` reaches the app in one
message once it is all in. uvicorn hands over what has arrived at each read (an
880 KB body: a dozen wake-ups of the app, each copying the part so far out of a
bytearray grown by copying), and stops reading past 64 KiB until the app asks
again; the gate reads every gated body whole anyway. Here the chunks are kept as
received and joined once (under the image load of ``benchmarks/p7_proxies.py``,
~0.3 ms of the gateway's CPU per request). The reads that follow the headers go to
the body straight, past llhttp, which would copy each into a new bytes object only
to hand it over (~6% more), and a fresh parser takes the next request. Where 64 KiB
or more are still to come, the kernel reads them into the body's own ``bytes``
(``body_reader``): no copy per read, no join (~11% of the image request's CPU). A body
without a length (chunked: a client streaming as it goes) or a longer one is handed
over as it arrives, as uvicorn does.

uvicorn writes the status line and headers the moment ``http.response.start``
arrives and the body when ``http.response.body`` does: two ``send`` calls, two
packets, two wake-ups of the client for every small response. A proxy holds the
whole answer of a small upstream response at once, so the two messages come in the
same turn of the event loop; writes made in one turn here leave together at the end
of it (what Envoy and nginx do with their write buffers): ~9% less CPU per small
proxied request under ``modalgate serve`` (``benchmarks/p7_proxies.py``, text body).

A client that goes silent while its request is being read (headers or body) is
answered ``408 request_timeout`` once nothing has arrived for ``read_timeout_s``, and
the connection closed: uvicorn times out only the wait between requests, so a
client sending a byte now and then (slowloris) would hold its connection and the
body read so far for ever. Connections that never start a request are closed
quietly after as long. A request line and headers longer than ``max_header_bytes``
are answered ``431 headers_too_large``: llhttp sets no limit, so a client sending
header lines without end would grow the gateway's memory as long as it kept on.

Used by ``modalgate serve``; other servers hosting the app write as they do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from functools import lru_cache, partial
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from modalgate.errors import ErrorCode, Violation, error_json
from modalgate.gateway.body_reader import WholeBodyReader

# Past this many bytes held, writes go out at once: a fast upstream's stream
# must not pile up here while the loop turn goes on.
FLUSH_AT_BYTES = 64 * 1024
# The rest of a whole body, from this size on, is read into it in place (``body_reader``);
# less arrives in a read or two, not worth swapping protocols for.
IN_PLACE_MIN_BYTES = 64 * 1024
# A request body of a declared length up to this is handed to the app whole (the gate
# reads up to the policy's max_body_bytes, 64 MiB by default, whole in any case).
WHOLE_BODY_BYTES = 4 * 1024 * 1024
# The request line and headers together, at most (Envoy's default is 60 KiB; nginx's
# large_client_header_buffers 32 KiB).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# An ASGI extension of this protocol's: ``scope["extensions"][ON_CLIENT_GONE](callback)``
# calls ``callback`` when the client's connection is lost, and returns a function that
# forgets it. The proxy uses it to cancel an abandoned upstream request; under other
# servers it keeps a task waiting on ``receive`` for ``http.disconnect`` instead (11% of
# a small proxied request's CPU under serve, A/B with P7's text load).
ON_CLIENT_GONE = "modalgate.on_client_gone"

# Set in a request's ``scope["extensions"]`` when the protocol itself answered it (the
# status), for the access log: the app saw only the client going away.
ANSWERED_BY_SERVER = "modalgate.answered_by_server"

# An app may offer a method of this name, taking a ``Violation``, to count the requests
# the protocol refused itself (408, 431): ``modalgate serve``'s ``Gateway`` does.
PROTOCOL_REFUSED = "protocol_refused"

logger = logging.getLogger("modalgate.protocol")


class CoalescingTransport:
    """The transport as the protocol sees it: writes wait for the end of the loop turn."""

    __slots__ = ("_held", "_held_bytes", "_loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None
        self._held_bytes = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        held = self._held
        if held is None:
            self._held = [data]
            self._held_bytes = len(data)
            self._loop.call_soon(self.flush)
        else:
            held.append(data)
            self._held_bytes += len(data)
        if self._held_bytes >= FLUSH_AT_BYTES:
            self.flush()

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        held = self._held
        if held is None:
            return
        self._held = None
        if self.transport.is_closing():
            return
        self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()  # a closing transport still sends what it was given
        self.transport.close()

    def write_eof(self) -> None:
        self.flush()  # what was written before the end goes before it
        self.transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self.transport.abort()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescingTransport(transport, self.loop)  # type: ignore[assignment]


class _BodySoFar:
    """Stands in for uvicorn's ``cycle.body`` bytearray: the chunks as received, joined
    once by ``bytes()`` in uvicorn's ``receive`` (no copy for a body read in one piece)."""

    __slots__ = ("chunks", "size", "whole")

    def __init__(self, start: bytes | bytearray, whole: bool) -> None:
        self.chunks: list[bytes] = [bytes(start)] if start else []  # bytes: the same object
        self.size = len(start)
        self.whole = whole  # held until the request's end

    def __iadd__(self, data: bytes) -> _BodySoFar:
        self.chunks.append(data)
        self.size += len(data)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        chunks = self.chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ServeHttpProtocol(CoalescingHttpToolsProtocol):
    """``modalgate serve``'s protocol: request bodies whole (above), writes coalesced,
    the client's going away told by a callback (``ON_CLIENT_GONE``), a silent client
    timed out while its request is read (``read_timeout_s``; None: never), and a
    request's head capped in size (``max_header_bytes``)."""

    def __init__(
        self,
        *args: Any,
        read_timeout_s: float | None = None,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes
        self._in_head = False  # between a request's first byte and its headers' end
        self._head_bytes = 0
        self._reading = True  # a request (the connection's first, or one begun) is due
        self._request_begun = False
        self._cycle_before: RequestResponseCycle | None = None  # the last request's
        self._whole = False  # this request's body is handed over whole
        self._body_left = 0  # bytes of a whole body still to come
        self._last_read = 0.0
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._gone = False
        self._on_gone: list[Callable[[], object]] = []
        if self.read_timeout_s is not None:
            self._last_read = self.loop.time()
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._check_reading)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        left = self._body_left
        if left <= 0:
            super().data_received(data)
            if self._in_head:  # still: count what the head has taken so far
                self._head_bytes += len(data)
                if self._head_bytes > self.max_header_bytes:
                    self._refuse_head()
            elif self._body_left >= IN_PLACE_MIN_BYTES:
                self._read_body_in_place()
            return
        # The rest of a whole body of known length: kept as read. llhttp would copy each
        # read into a new bytes object to hand it over; it learns nothing from the bytes.
        if len(data) < left:
            self._body_left = left - len(data)
            self.on_body_read(data)
            return
        self.on_body_read(data if len(data) == left else data[:left])
        self._body_whole()
        if len(data) > left:  # a pipelined request follows
            super().data_received(data[left:])

    def _read_body_in_place(self) -> None:
        """The rest of this whole body read straight into it (``body_reader``), unless
        something else holds the reads: flow control, an answer already sent, a close."""
        cycle = self.cycle
        if self.flow.read_paused or cycle.response_complete or self.transport.is_closing():
            return  # the reads go on through data_received
        so_far = cycle.body
        start = so_far.chunks if type(so_far) is _BodySoFar else (so_far,)
        size = len(so_far) + self._body_left
        transport = self.transport.transport  # type: ignore[attr-defined]
        WholeBodyReader(self, transport, start, size, self._note_read, self._body_in_place)

    def _note_read(self) -> None:
        self._last_read = self.loop.time()

    def _body_in_place(self, body: bytes) -> None:
        if not self.cycle.response_complete:
            self.cycle.body = _BodySoFar(body, whole=True)
        self._body_whole()

    def _body_whole(self) -> None:
        """A whole body read past llhttp is in: the app wakes, a fresh parser reads on."""
        self._body_left = 0
        self._fresh_parser()  # the old one is mid-body; the next request starts anew
        self.on_message_complete()

    def on_body_read(self, data: bytes) -> None:
        cycle = self.cycle
        if cycle.response_complete:
            return  # answered already (say, refused from its headers): the rest is dropped
        so_far = cycle.body
        if type(so_far) is not _BodySoFar:
            so_far = cycle.body = _BodySoFar(so_far, whole=True)
        so_far += data

    def _fresh_parser(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        with suppress(AttributeError):  # as uvicorn sets up its own (httptools >= 0.6)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)

    def on_message_begin(self) -> None:
        self._cycle_before = self.cycle
        super().on_message_begin()
        self._reading = self._request_begun = self._in_head = True
        self._head_bytes = 0

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = self._request_begun = False

    def _refuse_head(self) -> None:
        """431, and the connection closed: the head cannot be parsed past its end."""
        self._in_head = False
        if self.transport.is_closing():
            return  # llhttp refused the bytes already (uvicorn answered 400)
        self.transport.write(_head_too_large_response(self.max_header_bytes))
        self.transport.close()
        self._refused("client_headers_too_large", _head_too_large(self.max_header_bytes))

    def _refused(self, event: str, violation: Violation) -> None:
        """Logged here (with the client's address), and counted by the app if it counts."""
        client = f"{self.client[0]}:{self.client[1]}" if self.client else None
        fields = {"status": violation.status, "code": str(violation.code), "client": client}
        logger.info(event, extra={"fields": fields})
        count = getattr(self.app, PROTOCOL_REFUSED, None)
        if count is not None:
            count(violation)

    def _check_reading(self) -> None:
        """One timer per connection, re-armed as it fires (no timer made per request):
        the client has gone silent for ``read_timeout_s`` while a request is due, or the
        timer is set for the time left."""
        assert self.read_timeout_s is not None
        self._read_timer = None
        protocol = self.transport.get_protocol()
        if (
            self._gone
            or self.transport.is_closing()
            or (protocol is not self and getattr(protocol, "owner", None) is not self)
        ):
            return  # closed, or upgraded to a websocket
        silent_for = self.loop.time() - self._last_read
        if not self._reading or self.flow.read_paused or silent_for < self.read_timeout_s:
            # Between requests uvicorn's keep-alive timeout rules; paused: we stopped reading.
            wait = self.read_timeout_s if not self._reading else self.read_timeout_s - silent_for
            self._read_timer = self.loop.call_later(max(wait, 0.001), self._check_reading)
            return
        # This request's cycle (its headers are in) may have answered already: then no 408.
        cycle = self.cycle if self.cycle is not self._cycle_before else None
        if self._request_begun and (cycle is None or not cycle.response_started):
            self.transport.write(_timed_out_response(self.read_timeout_s))
            if cycle is not None:  # its headers were in: the app is waiting for the body
                cycle.scope.setdefault("extensions", {})[ANSWERED_BY_SERVER] = 408  # type: ignore[typeddict-item]
            self._refused("client_timed_out", _timed_out(self.read_timeout_s))
        self.transport.close()  # the app waiting for the body hears http.disconnect

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        self.scope.setdefault("extensions", {})[ON_CLIENT_GONE] = self._call_when_gone  # type: ignore[typeddict-item]
        cycle = self.cycle
        length = None
        # Not an upgrade (llhttp treats what follows its headers otherwise).
        if cycle is not None and cycle.scope is self.scope and not self.parser.should_upgrade():
            length = _whole_body_length(cycle)
        self._whole = length is not None
        self._body_left = length or 0

    def _call_when_gone(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` once the connection is lost (at once if it is); the function
        returned forgets it."""
        if self._gone:
            self.loop.call_soon(callback)
            return _nothing
        self._on_gone.append(callback)
        return partial(_forget, self._on_gone, callback)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._gone = True
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        callbacks, self._on_gone = self._on_gone, []
        for callback in callbacks:
            callback()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        self._body_left -= len(body)
        if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return
        so_far = cycle.body
        if type(so_far) is not _BodySoFar:  # uvicorn starts each part with a bytearray
            so_far = cycle.body = _BodySoFar(so_far, self._whole)
        so_far += body
        if so_far.whole:
            return  # on_message_complete wakes the app (or connection_lost, on a disconnect)
        if so_far.size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()


def _timed_out(timeout_s: float) -> Violation:
    message = f"the request did not arrive in full: nothing came for {timeout_s:g} s"
    return Violation(ErrorCode.REQUEST_TIMEOUT, message)


def _head_too_large(limit: int) -> Violation:
    message = f"the request line and headers are larger than {limit} bytes"
    return Violation(ErrorCode.HEADERS_TOO_LARGE, message)


def _timed_out_response(timeout_s: float) -> bytes:
    return _closing_answer(b"Request Timeout", _timed_out(timeout_s))


def _head_too_large_response(limit: int) -> bytes:
    return _closing_answer(b"Request Header Fields Too Large", _head_too_large(limit))


@lru_cache(maxsize=16)
def _closing_answer(reason: bytes, violation: Violation) -> bytes:
    """A whole answer in the error envelope, written by the protocol itself; the
    connection closes after it."""
    body = error_json([violation])
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % (violation.status, reason, len(body))
    )
    return head + body


def _forget(callbacks: list[Callable[[], object]], callback: Callable[[], object]) -> None:
    with suppress(ValueError):
        callbacks.remove(callback)


def _nothing() -> None:
    return None


def _whole_body_length(cycle: RequestResponseCycle) -> int | None:
    """The Content-Length, where it is at most ``WHOLE_BODY_BYTES`` and there is no
    Transfer-Encoding (llhttp refuses a request with both, and a length it cannot read)."""
    length = None
    for name, value in cycle.scope["headers"]:
        if name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            return None
    if length is None or not length.isdigit() or int(length) > WHOLE_BODY_BYTES:
        return None
    return int(length)
