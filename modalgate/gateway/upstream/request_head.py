"""The request head as the proxy writes it upstream: the caller's headers, checked for
CR, LF and NUL (request smuggling, header injection), with a framing header added
only where the body needs one."""

from __future__ import annotations

import httpx


def encode_head(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: object
) -> tuple[bytes, int | None, bool]:
    """The request head, the caller's Content-Length (None if absent), and whether the
    body goes chunked. Adds a framing header only: Content-Length for bytes without
    one, Transfer-Encoding for a stream without one; nothing else the caller did not give.
    """
    lines = [method + b" " + target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in headers]
    head = b"\r\n".join(lines)
    # One pass each over the whole block: a CR, LF or NUL anywhere in a name, value or
    # target shows as more line breaks than lines (request smuggling, header injection).
    if head.count(b"\n") != len(headers) or head.count(b"\r") != len(headers) or b"\0" in head:
        raise httpx.LocalProtocolError("CR, LF or NUL in the request line or a header")
    lowered = head.lower()
    length: int | None = None
    at = lowered.find(b"\r\ncontent-length:")
    if at >= 0:
        end = lowered.find(b"\r\n", at + 2)
        value = head[at + 17 : end if end >= 0 else len(head)].strip()
        if not value.isdigit():
            raise httpx.LocalProtocolError("the request's Content-Length is not a number")
        length = int(value)
    if length is not None and isinstance(body, bytes) and len(body) != length:
        # The upstream would read the difference as (part of) another request.
        raise httpx.LocalProtocolError("the request body does not match its Content-Length")
    chunked = length is None and body is not None
    if chunked and b"\r\ntransfer-encoding:" not in lowered:
        if isinstance(body, bytes):
            head += b"\r\ncontent-length: " + str(len(body)).encode()
            chunked = False
        else:
            head += b"\r\ntransfer-encoding: chunked"
    return head + b"\r\n\r\n", length, chunked
