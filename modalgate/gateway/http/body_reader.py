"""The rest of a request body of known length, read by the kernel straight into its
``bytes``.

A protocol's ``data_received`` gets each read as a new ``bytes`` object: the event
loop reads into its own buffer and copies out (uvloop's 256 KB buffer), and the
reads are then joined into the body, a second copy of all of it into a fresh
allocation. For the 1 MB image body of ``benchmarks/p7_proxies.py`` these two
copies were ~12% of ``modalgate serve``'s CPU per request (perf), where Envoy
copies once. ``WholeBodyReader`` is an ``asyncio.BufferedProtocol`` put on the
transport for the body's remaining bytes only: each read lands in the body where it
belongs, and the protocol that was reading is put back once the body is in.

The body is a ``bytes`` object filled in place (``writable_bytes``), as C code fills
the object ``PyBytes_FromStringAndSize(NULL, size)`` returns: it is handed on only
when every byte has been written, and nothing else sees it before. Where that C
API is not there (not CPython), it is a ``bytearray`` copied to ``bytes`` once.

The whole declared length (at most ``protocol.WHOLE_BODY_BYTES``) is allocated
when the reader starts, but the allocator hands out a block that size without
touching it: its pages become resident as the client's bytes are written in (200
readers of 4 MiB each, nothing received: +1-2 MiB resident, with and without
``server.reuse_big_buffers``; 200 of 16 MiB: +1.8 MB), so a client that declares a
length and sends nothing holds no more memory than before.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from collections.abc import Callable, Iterable
from typing import Any

_CPYTHON = sys.implementation.name == "cpython"
if _CPYTHON:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    # PyBytesObject ends in ``char ob_sval[1]``: the data starts one byte before its end.
    _DATA_OFFSET = bytes.__basicsize__ - 1


def writable_bytes(size: int) -> tuple[bytes | bytearray, memoryview]:
    """A new object of ``size`` bytes (contents undefined) and a writable view of them.

    Hand the object on only once the view has written every byte. ``size`` must be at
    least 2 (CPython shares its empty and one-byte objects). The view keeps the object
    alive (a ctypes array over foreign memory would not): drop it once the object is
    full, or it holds the body as long as it lives.
    """
    if size < 2:
        raise ValueError("at least 2 bytes")
    if not _CPYTHON:
        buffer = bytearray(size)
        return buffer, memoryview(buffer)
    body = _new_bytes(None, size)
    data = (ctypes.c_ubyte * size).from_address(id(body) + _DATA_OFFSET)
    data.owner = body  # type: ignore[attr-defined]
    return body, memoryview(data).cast("B")


def as_bytes(body: bytes | bytearray) -> bytes:
    return body if type(body) is bytes else bytes(body)


class WholeBodyReader(asyncio.BufferedProtocol):
    """On the transport while the rest of one body is read; the owner's otherwise.

    Reads are sized to the bytes still missing, so a pipelined request after the body
    stays in the socket for the owner. The owner hears ``read`` at each read,
    ``done(body)`` once the body is whole (its own protocol back on the transport),
    and everything else a protocol hears (the connection lost, EOF, write flow
    control) as if it were still the transport's protocol.
    """

    def __init__(
        self,
        owner: Any,
        transport: asyncio.Transport,
        start: Iterable[bytes],
        size: int,
        read: Callable[[], None],
        done: Callable[[bytes], None],
    ) -> None:
        self.owner = owner
        self.transport = transport
        self._read = read
        self._done = done
        self._body, self._view = writable_bytes(size)
        filled = 0
        for chunk in start:
            self._view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        self._filled = filled
        _switch(transport, self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self._read()
        if self._filled < len(self._view):
            return
        # uvloop keeps this reader's bound methods after the swap back (until the next
        # buffered protocol replaces them): the reader must not keep the body.
        body, self._body, self._view = self._body, b"", memoryview(b"")
        _switch(self.transport, self.owner)
        self._done(as_bytes(body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.owner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()


def _switch(transport: asyncio.Transport, protocol: asyncio.BaseProtocol) -> None:
    """``protocol`` on ``transport`` from its next read on. uvloop picks its read callbacks
    (buffered or not) when reading starts, so reading is restarted around the swap; a
    transport whose reading was paused stays paused (it picks them when resumed)."""
    reading = transport.is_reading()
    if reading:
        transport.pause_reading()
    transport.set_protocol(protocol)
    if reading:
        transport.resume_reading()
