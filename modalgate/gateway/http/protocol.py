"""``modalgate serve``'s HTTP/1.1 protocol: a request body handed over whole, heads
measured and capped, slow clients timed out. Its base, ``connection.Http11Protocol``, is
modalgate's own, on httptools' public parser (no uvicorn internals); uvicorn hosts it.

A body of a declared length up to ``WHOLE_BODY_BYTES`` reaches the app in one
message once it is all in. uvicorn's own protocol hands over what has arrived at each read (an
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

Writes made in one turn of the event loop leave together (``connection.CoalescingTransport``).

A client that goes silent while its request is being read (headers or body) is
answered ``408 request_timeout`` once nothing has arrived for ``read_timeout_s``, and
the connection closed: uvicorn times out only the wait between requests, so a
client sending a byte now and then (slowloris) would hold its connection and the
body read so far for ever. Silence alone is not enough (a byte every second is
never silent), so a head must also be in ``head_timeout_s`` after its first byte,
and a body ``body_timeout_s`` after its head plus a second for every
``body_min_rate`` bytes received (Apache's mod_reqtimeout ``MinRate``: a body that
keeps the rate is never cut off, one trickled slower is, soon after
``body_timeout_s``). One timer per connection looks at all three. Connections that
never start a request are closed quietly after ``read_timeout_s``. A request line
and headers longer than ``max_header_bytes`` are answered ``431
headers_too_large``: llhttp sets no limit, so a client sending header lines without
end would grow the gateway's memory as long as it kept on. Each head is counted
from its first byte to its end however the reads fall: llhttp is fed each read in
pieces that end where a head or body ends (``_parse``). A 400, 431 or 408 for a head
pipelined behind a request still being answered waits for that answer.

Used by ``modalgate serve``; other servers hosting the app write as they do.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from typing import Any

import httptools
from starlette.types import Receive, Scope, Send

from modalgate.errors import ErrorCode, Violation, error_json
from modalgate.gateway.http.body_reader import WholeBodyReader
from modalgate.gateway.http.connection import Http11Protocol, closing_answer, malformed, new_parser

# The rest of a whole body, from this size on, is read into it in place (``body_reader``);
# less arrives in a read or two, not worth swapping protocols for.
IN_PLACE_MIN_BYTES = 64 * 1024
# A request body of a declared length up to this is handed to the app whole (the gate
# reads up to the policy's max_body_bytes, 64 MiB by default, whole in any case). A chat
# that resends four 1 MB photos every turn is 5.3 MB: at 4 MiB it took the two-copy path
# (a bytes per read, then the gate's join), 5-7 ms of the gate's CPU on a repeated turn
# where 2.7-4.7 remain (benchmarks/conversation.py). The block is only reserved until
# the client's bytes land in it (body_reader), so a client that declares 16 MiB and
# sends nothing holds no more.
WHOLE_BODY_BYTES = 16 * 1024 * 1024
# A piece of a read fed to llhttp up to this size is copied out: cheaper than a view.
SMALL_PIECE_BYTES = 4096
# The request line and headers together, at most (Envoy's default is 60 KiB; nginx's
# large_client_header_buffers 32 KiB).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# After a refusal the protocol answers itself, how long the client's bytes are still
# read (and dropped) before the connection closes (``_close_lingering``).
LINGER_S = 2.0
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

# What the next bytes of a connection are: a head (or blank lines before one); the rest
# of a whole body (read past llhttp), of a longer body of declared length, or of a
# chunked one (both parsed by llhttp); or nothing to read (refused, closed, upgraded).
_HEAD, _CHUNKED, _WHOLE, _LENGTH, _DONE = range(5)  # in this order (``_parse``)
_NEVER = math.inf


class ServeHttpProtocol(Http11Protocol):
    """``modalgate serve``'s protocol: request bodies whole (above), writes coalesced,
    the client's going away told by a callback (``ON_CLIENT_GONE``), a request's head
    capped in size (``max_header_bytes``), and a client timed out while its request is
    read: silent for ``read_timeout_s``, or a head not in ``head_timeout_s`` after its
    first byte, or a body not in ``body_timeout_s`` after its head plus a second for
    every ``body_min_rate`` bytes received (None: no such limit).

    llhttp is fed each read in pieces that end where a head ends (its CRLF CRLF, found
    by ``bytes.find``), where a body of known length ends, and where a chunked body may
    end (it always ends in CRLF CRLF too): so the bytes of each head are counted
    exactly, however the reads fall, and nothing of a body is taken for a head."""

    def __init__(
        self,
        *args: Any,
        read_timeout_s: float | None = None,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        head_timeout_s: float | None = None,
        body_timeout_s: float | None = None,
        body_min_rate: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.body_min_rate = body_min_rate
        self._silence_s = _or_never(read_timeout_s)
        self._head_s = _or_never(head_timeout_s)
        self._body_s = _or_never(body_timeout_s)
        self._rate = _or_never(body_min_rate)  # bytes a second of body that earn a second
        # The timer looks at least this often: no deadline is missed by more than timers are.
        self._every = min(self._silence_s, self._head_s, self._body_s)
        self._phase = _HEAD
        self._head_bytes = 0  # of the head being read (blank lines before it included)
        self._tail = b""  # the last bytes of a head or chunked body that goes on past a read
        self._reading = True  # a request (the connection's first, or one begun) is due
        self._body_length = 0  # declared (0: chunked, counted down from 0 as it comes)
        self._body_left = 0  # bytes of a body of declared length still to come
        self._reader: WholeBodyReader | None = None
        self._last_read = 0.0
        self._head_since = 0.0
        self._body_since = 0.0
        self._read_timer: asyncio.TimerHandle | None = None
        self._paused = False  # reading was paused when the timer last looked
        self._deferred: tuple[bytes, str, Violation] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._gone = False
        self._on_gone: list[Callable[[], object]] = []
        if self._every != _NEVER:
            self._last_read = self.loop.time()
            self._read_timer = self.loop.call_later(self._every, self._check_reading)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        if self._phase != _WHOLE:
            self._parse(data, 0)
            return
        # The rest of a whole body of known length: kept as read. llhttp would copy each
        # read into a new bytes object to hand it over; it learns nothing from the bytes.
        left = self._body_left
        if len(data) < left:
            self._body_left = left - len(data)
            self.on_body_read(data)
            return
        self.on_body_read(data if len(data) == left else data[:left])
        self._body_whole()
        if len(data) > left:  # a pipelined request follows
            self._parse(data, left)

    def _parse(self, data: bytes, pos: int) -> None:
        """``data`` from ``pos`` to llhttp, a piece at a time: each ends where a head or a
        body ends (or may end), so each head is measured, and the next begins a piece.
        Each piece is fed as a read would be."""
        self.cancel_keep_alive()
        size = len(data)
        view = None
        while pos < size:
            phase = self._phase
            if phase <= _CHUNKED:  # a head, or a chunked body: both end in CRLF CRLF
                if self._tail:
                    end = self._block_end(data, pos)
                else:
                    end = data.find(b"\r\n\r\n", pos)
                    end = end + 4 if end >= 0 else -1
                stop = size if end < 0 else end
                if phase == _HEAD:
                    if self._head_bytes == 0:  # a request begins: its head's clock starts
                        self._head_since = self._last_read
                        self._reading = True
                    self._head_bytes += stop - pos
                    if self._head_bytes > self.max_header_bytes:
                        self._refuse_head()
                        return
                if end < 0:  # goes on in the next read: its last bytes may begin CRLF CRLF
                    self._tail = data[-3:] if size - pos >= 3 else (self._tail + data[pos:])[-3:]
                elif self._tail:
                    self._tail = b""
            elif phase == _DONE:
                return  # refused, timed out, closed after this request, or upgraded
            else:  # the part of a body of known length that this read holds
                stop = pos + self._body_left
                if stop > size or stop <= pos:  # (llhttp ends an empty body by itself)
                    stop = size
            if pos == 0 and stop == size:
                piece: bytes | memoryview = data
            elif stop - pos <= SMALL_PIECE_BYTES:
                piece = data[pos:stop]
            else:
                if view is None:
                    view = memoryview(data)
                piece = view[pos:stop]
            if not self.feed(piece):
                return  # refused, or an upgrade asked for: nothing more is read
            pos = stop
        if self._phase == _WHOLE and self._body_left >= IN_PLACE_MIN_BYTES:
            self._read_body_in_place()

    def _block_end(self, data: bytes, pos: int) -> int:
        """Where the first CRLF CRLF from ``pos`` ends, one begun in the last read
        (``_tail``) included, or -1. llhttp takes no other end of a head or a chunked
        body."""
        tail = self._tail
        if tail:
            at = (tail + data[pos : pos + 3]).find(b"\r\n\r\n")
            if at >= 0:
                return pos + at + 4 - len(tail)
        at = data.find(b"\r\n\r\n", pos)
        return at + 4 if at >= 0 else -1

    def _read_body_in_place(self) -> None:
        """The rest of this whole body read straight into it (``body_reader``), unless
        something else holds the reads: flow control, an answer already sent, a close."""
        cycle = self.cycle
        if self.flow.read_paused or cycle.response_complete or self.transport.is_closing():
            return  # the reads go on through data_received
        size = cycle.body_size + self._body_left
        self._reader = WholeBodyReader(
            self,
            self.transport.transport,
            cycle.body_chunks,
            size,
            self._note_read,
            self._body_in_place,
        )

    def _note_read(self) -> None:
        self._last_read = self.loop.time()

    def _body_in_place(self, body: bytes) -> None:
        self._reader = None
        cycle = self.cycle
        if not cycle.response_complete:
            cycle.body_chunks = [body]
            cycle.body_size = len(body)
        self._body_whole()

    def _body_whole(self) -> None:
        """A whole body read past llhttp is in: the app wakes, a fresh parser reads on."""
        self._body_left = 0
        self._fresh_parser()  # the old one is mid-body; the next request starts anew
        self.on_message_complete()

    def on_body_read(self, data: bytes) -> None:
        """A read of a whole body, past llhttp: kept as llhttp's ``on_body`` keeps a part
        (the app wakes once the body is whole)."""
        super().on_body(data)

    def _fresh_parser(self) -> None:
        self.parser = new_parser(self)

    def on_message_begin(self) -> None:
        if self._head_bytes == 0:
            # A request ended inside the piece fed and another began (pieces end where
            # requests do, so llhttp and this framing disagree): where it began is not
            # known, so neither is its size: answered 400, as bytes llhttp refuses are.
            raise httptools.HttpParserError("a request began where none could")
        super().on_message_begin()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = False
        self._head_bytes = 0
        self._tail = b""
        cycle = self.cycle
        # After a request that closes the connection, what follows is not read (as llhttp
        # leaves it, lenient_data_after_close).
        self._phase = _HEAD if cycle is None or cycle.keep_alive else _DONE

    def refuse_upgrade(self) -> None:
        self._phase = _DONE  # llhttp reads nothing past a request that asks to upgrade
        super().refuse_upgrade()

    def refuse_malformed(self, reason: str) -> None:
        """llhttp refused the bytes: nothing after them is read. In a head, answered 400
        once the requests before it have their answers; in a body, at once (the app
        hears the client gone), unless its answer has begun (then the connection just
        closes)."""
        violation = malformed(reason)
        if self._phase == _HEAD:
            self._answer_head(closing_answer(violation), "client_request_malformed", violation)
        else:
            self._answer_in_body("client_request_malformed", violation)

    def _refuse_head(self) -> None:
        """431, and the connection closed: the head cannot be parsed past its end."""
        limit = self.max_header_bytes
        violation = _head_too_large(limit)
        self._answer_head(closing_answer(violation), "client_headers_too_large", violation)

    def _answer_head(self, answer: bytes, event: str, violation: Violation) -> None:
        """A request refused before its head is in: nothing more is read, and the answer
        goes (and the connection closes) once the requests before it, pipelined, have
        had theirs: the client reads the answers in order."""
        self._phase = _DONE
        self._reading = False
        before = self.cycle
        if before is not None and not before.response_complete:
            self._deferred = (answer, event, violation)
            self.flow.pause_reading()
            return
        self._answer_and_close(answer, event, violation)

    def _answer_and_close(self, answer: bytes, event: str, violation: Violation) -> None:
        if self.transport.is_closing():
            return  # closed already (the request before asked to close it)
        self.transport.write(answer)
        self._close_lingering()
        self._refused(event, violation)

    def _close_lingering(self) -> None:
        """The answer sent and our side shut, the client's bytes read and dropped for up
        to ``LINGER_S``, then closed (nginx's lingering close): a socket closed with
        unread bytes sends an RST, which can reach a client still sending before it has
        read the answer, and the answer is lost."""
        self._phase = _DONE  # what still comes is dropped (``_parse``)
        transport = self.transport
        if transport.get_protocol() is not self:  # a body read in place: its reader's reads
            transport.close()
            return
        try:
            transport.write_eof()
        except (NotImplementedError, RuntimeError, OSError):
            transport.close()
            return
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        deferred = self._deferred
        if deferred is not None and self.cycle.response_complete:
            self._deferred = None
            self._answer_and_close(*deferred)

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
        the client has gone silent, or its head or body is past its deadline, while a
        request is due; or the timer is set for the nearest of them (at most ``_every``
        away, so a request begun meanwhile is not looked at late)."""
        self._read_timer = None
        protocol = self.transport.get_protocol()
        if (
            self._gone
            or self.transport.is_closing()
            or (protocol is not self and getattr(protocol, "owner", None) is not self)
        ):
            return  # closed
        now = self.loop.time()
        phase = self._phase
        if not self._reading or phase == _DONE:
            # Between requests the keep-alive timeout rules; done: nothing is read.
            self._paused = False
            self._arm(self._every)
            return
        paused = self.flow.read_paused
        if paused or self._paused:
            # We stopped reading, not the client (flow control, a pipelined request
            # waiting its turn): its clocks start again once we read again (at the first
            # look that finds reading resumed, which is at most ``_every`` after it).
            self._paused = paused
            self._last_read = self._head_since = self._body_since = now
            self._arm(self._every)
            return
        begun = phase != _HEAD or self._head_bytes > 0
        if phase == _HEAD:
            deadline = self._head_since + self._head_s if begun else _NEVER
        else:
            deadline = self._body_since + self._body_s + self._body_received() / self._rate
        silent_until = self._last_read + self._silence_s
        due = min(deadline, silent_until)
        if now < due:
            self._arm(due - now)
            return
        if silent_until <= deadline:
            late = _timed_out(self._silence_s)
        elif phase == _HEAD:
            late = _head_late(self._head_s)
        else:
            late = _body_late(self._body_s, self._rate)
        if phase == _HEAD:
            if begun:
                self._answer_head(closing_answer(late), "client_timed_out", late)
            else:
                self.transport.close()  # never began a request: closed without an answer
            return
        self._answer_in_body("client_timed_out", late)

    def _answer_in_body(self, event: str, violation: Violation) -> None:
        """This request (its headers are in) refused while its body is read: answered and
        closed, unless its answer has begun (then only closed)."""
        self._phase = _DONE
        self._reading = False
        cycle = self.cycle
        for turn, (queued, _app) in enumerate(self.pipeline):
            if queued is cycle:  # pipelined, its turn not come: answered in its turn, then closed
                self.pipeline[turn] = (cycle, partial(_answer, violation))
                self._refused(event, violation)
                return
        if cycle.response_started:
            self.transport.close()
            return
        self.transport.write(closing_answer(violation))
        cycle.scope.setdefault("extensions", {})[ANSWERED_BY_SERVER] = violation.status
        self._refused(event, violation)
        # The app waiting for the body hears http.disconnect now, not when the linger ends.
        cycle.disconnected = True
        cycle.message_event.set()
        self._close_lingering()

    def _arm(self, wait: float) -> None:
        self._read_timer = self.loop.call_later(
            max(min(wait, self._every), 0.001), self._check_reading
        )

    def _body_received(self) -> int:
        """Bytes of this body in so far (a chunked one's count runs down from 0)."""
        reader = self._reader
        left = self._body_left if reader is None else reader.get_buffer(0).nbytes
        return self._body_length - left

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.scope.setdefault("extensions", {})[ON_CLIENT_GONE] = self._call_when_gone  # type: ignore[typeddict-item]
        self._tail = b""
        self._body_since = self._last_read
        cycle = self.cycle
        if self.parser.should_upgrade():
            cycle.keep_alive = False  # answered as HTTP/1.1, then closed (``refuse_upgrade``)
        length, chunked = _declared_body(self.headers)
        # No body: llhttp ends the request at once (on_message_complete).
        if chunked:
            self._phase = _CHUNKED
        else:
            self._phase = _WHOLE if 0 < length <= WHOLE_BODY_BYTES else _LENGTH
        cycle.whole = self._phase == _WHOLE
        self._body_length = self._body_left = length

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
        self._deferred = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        callbacks, self._on_gone = self._on_gone, []
        for callback in callbacks:
            callback()

    def on_body(self, body: bytes) -> None:
        self._body_left -= len(body)
        super().on_body(body)


def _timed_out(timeout_s: float) -> Violation:
    message = f"the request did not arrive in full: nothing came for {timeout_s:g} s"
    return Violation(ErrorCode.REQUEST_TIMEOUT, message)


def _head_late(timeout_s: float) -> Violation:
    message = f"the request line and headers did not arrive in full within {timeout_s:g} s"
    return Violation(ErrorCode.REQUEST_TIMEOUT, message)


def _body_late(timeout_s: float, rate: float) -> Violation:
    message = (
        f"the request body did not arrive in time: {timeout_s:g} s, and 1 s more for every"
        f" {rate:g} bytes received"
    )
    return Violation(ErrorCode.REQUEST_TIMEOUT, message)


def _head_too_large(limit: int) -> Violation:
    message = f"the request line and headers are larger than {limit} bytes"
    return Violation(ErrorCode.HEADERS_TOO_LARGE, message)


async def _answer(violation: Violation, scope: Scope, receive: Receive, send: Send) -> None:
    """A pipelined request the protocol refused, answered through its cycle in its turn."""
    body = error_json([violation])
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": violation.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _forget(callbacks: list[Callable[[], object]], callback: Callable[[], object]) -> None:
    with suppress(ValueError):
        callbacks.remove(callback)


def _nothing() -> None:
    return None


def _or_never(seconds: float | None) -> float:
    return _NEVER if seconds is None else seconds


def _declared_body(headers: list[tuple[bytes, bytes]]) -> tuple[int, bool]:
    """The Content-Length (0 without one), and whether the body is chunked instead
    (llhttp refuses a request with both, a length it cannot read, and a request whose
    Transfer-Encoding does not end in chunked)."""
    length = b"0"
    for name, value in headers:
        if name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            return 0, True
    return int(length) if length.isdigit() else 0, False
