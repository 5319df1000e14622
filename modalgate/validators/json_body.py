"""Reading a request body, and rewriting it without changing what the gate did not change.

The upstream must read a body exactly as the gate judged it. Two things break
that with an ordinary parse: duplicate keys (the gate and the server may keep
different copies: they are refused) and numbers a re-serialisation cannot
reproduce (integers beyond 64 bits crash orjson; ``1e400`` parses as ``inf``
and comes out as ``null``). Validation parses with plain floats (what callers
of ``Verdict.request`` expect); a rewrite (inlined media, a fallback model,
embeddings) parses the body again with every float kept as its source text,
replaces only the values it means to, and writes every number back as sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import jiter
import orjson

from modalgate.errors import ErrorCode, Violation

_BOM = b"\xef\xbb\xbf"
_DUPLICATE = re.compile(r'^Detected duplicate key "(.*)" at line (\d+) column (\d+)$', re.S)
_INT64 = (-(2**63), 2**64 - 1)  # orjson writes int64 and uint64


Location = tuple[str | int, ...]  # keys and indexes from the body's root to a value


def parse_json_body(body: bytes) -> Any | Violation:
    """The parsed body, or the ``invalid_json`` violation that says what is wrong with it.

    A UTF-8 byte order mark is skipped, as the engines' own parsers (Python's
    ``json``) skip it; the body is still forwarded byte for byte.
    """
    text = body[3:] if body.startswith(_BOM) else body  # (``_without_bom``, without a call)
    try:
        return jiter.from_json(text, allow_inf_nan=False, catch_duplicate_keys=True)
    except ValueError as exc:
        return _json_problem(body, str(exc))


def rewrite_json_body(body: bytes, replacements: Iterable[tuple[Location, Any]]) -> bytes:
    """``body`` (already validated) with the values at these locations replaced."""
    tree = jiter.from_json(_without_bom(body), float_mode="lossless-float")
    for location, value in replacements:
        container, key = locate(tree, location)
        container[key] = value
    return dump_json_body(tree)


def locate(tree: Any, location: Location) -> tuple[Any, str | int]:
    """The container holding the value at ``location``, and its key there."""
    *parents, last = location
    container = tree
    for step in parents:
        container = container[step]
    if isinstance(last, int) != isinstance(container, list):
        raise KeyError(last)
    return container, last


def location_of(param: str) -> Location:
    """The inverse of ``errors.path``: ``messages.[1].content.[0]`` -> ("messages", 1, ...).

    Params name only keys the validators know, none with a dot or brackets in it.
    """
    return tuple(
        int(step[1:-1]) if step.startswith("[") and step.endswith("]") else step
        for step in param.split(".")
    )


def dump_json_body(value: Any) -> bytes:
    """Serialise a parsed body, every number as it was sent."""
    try:
        return orjson.dumps(value, default=_verbatim_float)
    except orjson.JSONEncodeError:
        # Integers beyond 64 bits: rare, so only then is the tree walked to keep them.
        return orjson.dumps(_big_ints_verbatim(value), default=_verbatim_float)


def _without_bom(body: bytes) -> bytes:
    return body[3:] if body.startswith(_BOM) else body


def _verbatim_float(value: Any) -> orjson.Fragment:
    if isinstance(value, jiter.LosslessFloat):
        return orjson.Fragment(bytes(value))
    raise TypeError  # orjson turns this into its own "not serializable" error


def _big_ints_verbatim(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _big_ints_verbatim(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_big_ints_verbatim(item) for item in value]
    if type(value) is int and not _INT64[0] <= value <= _INT64[1]:
        return orjson.Fragment(str(value).encode())
    return value


def _json_problem(body: bytes, reason: str) -> Violation:
    """Name the problem; jiter's own text ("expected value at line 1 column 7") is safe."""
    duplicate = _DUPLICATE.match(reason)
    if duplicate is not None:
        key, line, column = duplicate.groups()
        shown = key if len(key) <= 60 else key[:60] + "..."
        return Violation(
            ErrorCode.INVALID_JSON,
            f"the request body repeats the key {shown!r} in one object (line {line}, column "
            f"{column}); servers disagree on which copy counts, so send each key once",
        )
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return Violation(ErrorCode.INVALID_JSON, "the request body is not valid UTF-8")
    if not body.strip():
        return Violation(ErrorCode.INVALID_JSON, "the request body is empty")
    if "recursion limit" in reason:
        return Violation(ErrorCode.INVALID_JSON, "the request body is nested too deeply")
    return Violation(ErrorCode.INVALID_JSON, f"the request body is not valid JSON: {reason[:120]}")
