"""uvicorn's httptools protocol, with a response's head and body sent in one write.

uvicorn writes the status line and headers the moment ``http.response.start``
arrives and the body when ``http.response.body`` does: two ``send`` calls, two
packets, two wake-ups of the client for every small response. A proxy holds the
whole answer of a small upstream response at once, so the two messages come in the
same turn of the event loop; writes made in one turn here leave together at the end
of it (what Envoy and nginx do with their write buffers): ~9% less CPU per small
proxied request under ``modalgate serve`` (``benchmarks/p7_proxies.py``, text body).

Used by ``modalgate serve``; other servers hosting the app write as they do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Past this many bytes held, writes go out at once: a fast upstream's stream
# must not pile up here while the loop turn goes on.
FLUSH_AT_BYTES = 64 * 1024


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
