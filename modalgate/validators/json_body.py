"""Reading a request body, and rewriting it without changing what the gate did not change.

The upstream must read a body exactly as the gate judged it. Two things break
that with an ordinary parse: duplicate keys (the gate and the server may keep
different copies: they are refused) and numbers a re-serialisation cannot
reproduce (integers beyond 64 bits crash orjson; ``1e400`` parses as ``inf``
and comes out as ``null``). Validation parses with plain floats (what callers
of ``Verdict.request`` expect); a rewrite (inlined media, a fallback model,
embeddings) parses the body again with every float kept as its source text,
replaces only the values it means to, and writes every number back as sent.

A big body's long data URL payloads can be read where they lie (``payloads_aside``):
the parser then sees a short token in each one's place, and the base64 is decoded
from the body's own bytes, without a Python string of it (or a slice of that).

A parsed tree can take many times the bytes of its text: ``{}`` is 3 bytes and a
64-byte dict (with its slot, 80 at the peak), so 30 MB of them took 760 MB. Before
a big body is parsed, its values are counted from the characters that open them
(``tree_problem``), each weighed at the most it was measured to take, and a body
whose tree could take more than ``TREE_BYTES_PER_BODY_BYTE`` times its size (plus
``TREE_ALLOWANCE_BYTES``) is refused before anything is built.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jiter
import orjson
import pybase64

from modalgate.errors import ErrorCode, Violation

_BOM = b"\xef\xbb\xbf"
_DUPLICATE = re.compile(r'^Detected duplicate key "(.*)" at line (\d+) column (\d+)$', re.S)
_INT64 = (-(2**63), 2**64 - 1)  # orjson writes int64 and uint64


Location = tuple[str | int, ...]  # keys and indexes from the body's root to a value

# A data URL payload this long is set aside (``payloads_aside``); shorter ones cost
# less as strings than the search for them.
ASIDE_MIN_PAYLOAD = 16 * 1024
_BASE64_MARK = b";base64,"


# The most a parsed value was measured to take, at the peak of its parse (CPython 3.11,
# jiter 0.19, its duplicate-key set and lossless floats included), by the character
# before it outside strings: ``{`` or ``[`` a container and its first value (``{}`` 80 B,
# ``[1]`` 80, a one-key dict 209 with its ``:`` and ``,``), ``,`` the value after it (a
# float 48, a lossless float 108, a new short string 72), ``:`` a key and its entry (a
# new key in a growing dict, with jiter's duplicate-key set: 162).
_OPEN_BYTES = 144
_COMMA_BYTES = 112
_COLON_BYTES = 176
# A tree may take this many bytes per byte of its text, and this many more: the few MB
# of any ordinary body (a long chat of short messages weighs ~18 bytes a byte).
TREE_BYTES_PER_BODY_BYTE = 3
TREE_ALLOWANCE_BYTES = 16 * 1024 * 1024
# Below this a body's tree fits the allowance whatever it holds: not counted.
_COUNTED_FROM = TREE_ALLOWANCE_BYTES // _COLON_BYTES
_ONLY_OPENERS = bytes(sorted(set(range(256)) - set(b"{[,:")))
_OPENERS_AND_QUOTES = bytes(sorted(set(range(256)) - set(b'{[,:"')))
_STRING = re.compile(rb'"[^"]*"')  # in the openers and quotes: a string's, inside it


def parse_json_body(body: bytes) -> Any | Violation:
    """The parsed body, or the ``invalid_json`` violation that says what is wrong with it
    (``payload_too_large``: its tree could take too much memory, ``tree_problem``).

    A UTF-8 byte order mark is skipped, as the engines' own parsers (Python's
    ``json``) skip it; the body is still forwarded byte for byte.
    """
    text = body[3:] if body.startswith(_BOM) else body  # (``_without_bom``, without a call)
    if len(text) > _COUNTED_FROM:
        too_many = tree_problem(text)
        if too_many is not None:
            return too_many
    try:
        return jiter.from_json(text, allow_inf_nan=False, catch_duplicate_keys=True)
    except ValueError as exc:
        return _json_problem(body, str(exc))


def tree_problem(text: bytes) -> Violation | None:
    """Why ``text`` is not to be parsed, where its tree could take more memory than its
    size allows; None where it may be.

    The characters that open values are counted at C speed in two passes at most: all
    of them (most bodies end here: base64 and prose hold few), then those outside
    strings, found once escapes are dropped (a backslash pair, then an escaped quote:
    what is left of a run of backslashes escapes the character after it). Strings in
    JSON are separated by a ``,`` or ``:``, so a body of more strings than its
    allowance has room for such separators is refused without looking inside them.
    That second pass costs a few ns a byte; it holds at most two copies of the text.
    """
    allowed = TREE_BYTES_PER_BODY_BYTE * len(text) + TREE_ALLOWANCE_BYTES
    openers = text.translate(None, _ONLY_OPENERS)
    if _tree_bytes(openers) <= allowed:
        return None
    del openers
    if b"\\" in text:  # a backslash pair, then what is left: an escaped quote
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = text.translate(None, _OPENERS_AND_QUOTES)
    del text
    strings = outside.count(b'"') // 2
    if (strings - 1) * _COMMA_BYTES <= allowed:
        outside = _STRING.sub(b"", outside)
        if _tree_bytes(outside) <= allowed:
            return None
    return _too_many_values(allowed)


def _tree_bytes(openers: bytes) -> int:
    return (
        _OPEN_BYTES * (openers.count(b"{") + openers.count(b"["))
        + _COMMA_BYTES * openers.count(b",")
        + _COLON_BYTES * openers.count(b":")
    )


def _too_many_values(allowed: int) -> Violation:
    return Violation(
        ErrorCode.PAYLOAD_TOO_LARGE,
        "the request body holds too many JSON values for its size: parsed, they could take"
        f" more than {allowed} bytes of memory; send fewer, larger values (long strings"
        " and base64 cost little)",
    )


def payloads_aside(
    body: bytes, known_run: Callable[[bytes, int], bytes | None] | None = None
) -> tuple[bytes, dict[str, memoryview | bytes]]:
    """``body`` with each long data URL payload swapped for a token, and the payloads by token.

    A payload is the run from ``;base64,`` to the next ``"``. Whether that run was
    really all of one JSON string's tail, and where the tree holds it, only the
    reader knows: it takes each token (``dict.pop``) where it reads a data URL and
    decodes the bytes strictly, and a verdict counts only if every token was taken
    once and decoded (``validators.request``). A strict decode proves the run holds
    nothing but the base64 alphabet (no quote, backslash or control character), so
    the body and the skeleton have the same structure: the skeleton is the body
    with those strings shortened. The tokens hold 64 random bits, so no client can
    write one elsewhere in its body, and a ``-``, outside the base64 alphabet, so a
    token read as a payload never decodes.

    ``known_run`` (``VerdictCache.known_run``): a payload already judged is recognised
    by one comparison instead of the scan for its closing quote, and set aside as the
    very text that was judged (it held nothing but the base64 alphabet then).
    """
    start = body.find(_BASE64_MARK)
    if start < 0:
        return body, {}
    view, nonce = memoryview(body), os.urandom(8).hex()
    pieces: list[bytes | memoryview] = []
    aside: dict[str, memoryview | bytes] = {}
    done = 0
    while start >= 0:
        begin = start + len(_BASE64_MARK)
        known = known_run(body, begin) if known_run is not None else None
        end = begin + len(known) if known is not None else body.find(b'"', begin)
        if end < 0:
            break
        if end - begin >= ASIDE_MIN_PAYLOAD:
            token = f"{nonce}-{len(aside)}"
            pieces += (view[done:begin], token.encode())
            aside[token] = known if known is not None else view[begin:end]
            done = end
        start = body.find(_BASE64_MARK, end)
    if not aside:
        return body, {}
    pieces.append(view[done:])
    return b"".join(pieces), aside


class Unset:
    """A replacement that removes the key at its location (a URL moved to another key)."""


@dataclass(frozen=True, slots=True)
class Default:
    """A replacement that sets the key only where the object lacks it."""

    value: Any


def rewrite_json_body(body: bytes, replacements: Iterable[tuple[Location, Any]]) -> bytes:
    """``body`` (already validated) with the values at these locations replaced (or,
    for ``Unset`` and ``Default``, the key removed, or set where it is missing).

    Long base64 payloads are set aside first (``payloads_aside``) and put back after, so
    only the request's skeleton is parsed and written again: a photo's megabytes are
    copied once, not parsed and serialised."""
    skeleton, aside = payloads_aside(body)
    if aside and not all(_plain_base64(run) for run in aside.values()):
        skeleton, aside = body, {}  # a run that is not a whole payload: the slow, exact way
    tree = jiter.from_json(_without_bom(skeleton), float_mode="lossless-float")
    for location, value in replacements:
        container, key = locate(tree, location)
        if value is Unset:
            container.pop(key, None)
        elif isinstance(value, Default):
            container.setdefault(key, value.value)
        else:
            container[key] = value
    written = dump_json_body(tree)
    return _payloads_back(written, aside) if aside else written


def _plain_base64(run: memoryview) -> bool:
    """Whether the run is nothing but base64 (a strict decode: SIMD, ~0.15 ms a MB), so
    swapping it for a token leaves the JSON's structure as it was."""
    try:
        pybase64.b64decode(run, validate=True)
    except ValueError:
        return False
    return True


def _payloads_back(written: bytes, aside: dict[str, memoryview]) -> bytes:
    """Each token in ``written`` replaced by its payload, in document order; a token an
    edit removed (a part replaced whole) is simply not there."""
    pieces: list[bytes | memoryview] = []
    done = 0
    for token, run in aside.items():
        at = written.find(token.encode(), done)
        if at < 0:
            continue
        pieces += (memoryview(written)[done:at], run)
        done = at + len(token)
    pieces.append(memoryview(written)[done:])
    return b"".join(pieces)


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
    if not _is_utf8(body):
        return Violation(ErrorCode.INVALID_JSON, "the request body is not valid UTF-8")
    if not body or body.isspace():
        return Violation(ErrorCode.INVALID_JSON, "the request body is empty")
    if "recursion limit" in reason:
        return Violation(ErrorCode.INVALID_JSON, "the request body is nested too deeply")
    return Violation(ErrorCode.INVALID_JSON, f"the request body is not valid JSON: {reason[:120]}")


_UTF8_CHUNK = 1 << 20


def _is_utf8(body: bytes) -> bool:
    """Checked a MiB at a time: the whole body as one string could take 4 bytes a byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    try:
        for start in range(0, len(body), _UTF8_CHUNK):
            decoder.decode(view[start : start + _UTF8_CHUNK])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True
