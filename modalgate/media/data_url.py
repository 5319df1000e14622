"""Data URLs and base64, without copying or decoding more than a check needs."""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass

import pybase64

_WHITESPACE = re.compile(r"[\s]+")
_WHITESPACE_BYTES = re.compile(rb"\s+")


class Base64Error(ValueError):
    """The payload is not base64 (the text says why, in client terms)."""


@dataclass(frozen=True, slots=True)
class DataUrl:
    mime: str  # lower-cased, parameters dropped; "" when absent
    is_base64: bool
    payload: str


def parse_data_url(url: str) -> DataUrl | None:
    """Split ``data:[<mime>][;params][;base64],<payload>``; ``None`` if there is no comma."""
    comma = url.find(",", 5, 5 + 1024)
    if comma < 0:
        return None
    header = url[5:comma].strip()
    fields = [f.strip() for f in header.split(";")]
    is_base64 = len(fields) > 1 and fields[-1].lower() == "base64"
    return DataUrl(mime=fields[0].lower(), is_base64=is_base64, payload=url[comma + 1 :])


def decoded_size(payload: str | memoryview | bytes, *, wrapped: bool = False) -> int:
    """Bytes the payload decodes to, from its length alone (exact for valid base64).

    ``wrapped`` discounts line breaks and spaces first: a scan, so callers ask
    for it only when the fast answer is over a limit. ``payload`` may be the
    body's own bytes (``validators.json_body.payloads_aside``), or a text judged before.
    """
    if not isinstance(payload, str):
        if wrapped:
            payload = _WHITESPACE_BYTES.sub(b"", payload)
        tail = bytes(payload[-2:]).decode("latin-1")
    else:
        if wrapped:
            payload = _WHITESPACE.sub("", payload)
        tail = payload[-2:]
    n = len(payload)
    padding = 2 if tail == "==" else 1 if tail.endswith("=") else 0
    return n // 4 * 3 - padding + (n % 4 * 3 // 4)


def decode_base64(payload: str | memoryview | bytes) -> bytes:
    """Strict decode; line-wrapped (MIME-style) base64 is accepted, as servers accept it.

    A payload read from the body's bytes is decoded strictly only: its reader
    reads the body again as text where that fails (``validators.request``).
    """
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        if not isinstance(payload, str):
            raise Base64Error("the base64 payload is not strict base64") from None
    stripped = _WHITESPACE.sub("", payload)
    if stripped != payload:
        try:
            return pybase64.b64decode(stripped, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise Base64Error(_why_invalid(stripped))


def _why_invalid(payload: str) -> str:
    if not payload:
        return "the base64 payload is empty"
    if len(payload) % 4:
        return "the base64 payload has a length that is not a multiple of 4 (truncated?)"
    return "the base64 payload contains characters outside the base64 alphabet"
