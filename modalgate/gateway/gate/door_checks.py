"""What the gate decides from a request's head alone, before its body is read: the
headers that describe the body, the method a door takes it on, doors that are closed."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Scope

from modalgate.errors import ErrorCode, Violation, payload_too_large
from modalgate.validators.request import Api

POST_ONLY = frozenset({"POST"})


def method_not_allowed(methods: frozenset[str]) -> Violation:
    return Violation(
        ErrorCode.METHOD_NOT_ALLOWED,
        f"this path takes its request body with {', '.join(sorted(methods))} only",
    )


# How a path is gated: its API, whether it is enforced, its raw_path where the route is
# one of the given paths (None otherwise), the methods its body is taken on.
Route = tuple[Api, bool, "bytes | None", frozenset[str]]


def closed_door(path: str) -> Violation:
    return Violation(
        ErrorCode.NOT_FOUND,
        f"{path[:100]!r} carries media in a shape modalgate does not read, so it is closed"
        " here (docs/policy.md#endpoints)",
    )


def not_a_door(path: str, engine: str) -> Violation:
    return Violation(
        ErrorCode.NOT_FOUND,
        f"{path[:100]!r} is not a door of {engine} that modalgate knows, so a body sent"
        " there is not passed on (docs/policy.md#endpoints)",
    )


def has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


_BODY_HEADERS = frozenset((b"content-type", b"content-length", b"content-encoding"))


def last_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    value = None
    for key, found in headers:
        if key == name:
            value = found
    return value


def header_refusal(
    headers: Iterable[tuple[bytes, bytes]], cap: int, short: int = 0, form: bool = False
) -> Violation | None:
    """What is wrong with the three headers that describe the body (the last of each
    counts; ASGI servers send lower-case names), read in one pass over the headers.
    A Content-Length of at most ``short`` digits is under ``cap`` without ``int``
    (~1,100 instructions). ``form``: the body is a multipart form (an audio upload)."""
    content_type = encoding = length = None
    for name, value in headers:
        if name not in _BODY_HEADERS:  # one hash lookup for the many headers that are not
            continue
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            length = value
        else:
            encoding = value
    if form:
        main = (content_type or b"").split(b";", 1)[0].strip().lower()
        if main != b"multipart/form-data":
            return Violation(
                ErrorCode.INVALID_REQUEST,
                "an audio upload must be sent as multipart/form-data",
            )
    elif content_type is not None and content_type != b"application/json":
        main = content_type.split(b";", 1)[0].strip().lower()
        if main != b"application/json" and not (
            main.startswith(b"application/") and main.endswith(b"+json")
        ):
            shown = main.decode("latin-1")[:60]
            return Violation(
                ErrorCode.INVALID_REQUEST,
                f"the request body must be JSON (Content-Type: application/json), not {shown!r}",
            )
    if encoding is not None and encoding.strip().lower() not in (b"identity", b""):
        return Violation(
            ErrorCode.INVALID_REQUEST,
            "compressed request bodies (Content-Encoding) are not accepted",
        )
    if length is not None and not (len(length) <= short and length.isdigit()):
        try:
            declared = int(length)
        except ValueError:
            return Violation(ErrorCode.INVALID_REQUEST, "the Content-Length header is not a number")
        if declared > cap:
            return payload_too_large(cap)
    return None
