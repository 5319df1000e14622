"""One spelling per path, before anything matches on it, and the same one forwarded.

``/v1/./chat/completions``, ``//v1/chat/completions``, ``/v1/x/../chat/completions``
and ``/v1/chat%2Fcompletions`` all reach a model server's chat handler, since
servers and their routers resolve dot segments, merge slashes or decode
``%2F``. A gate that matched the spelling would wave them through unchecked.
So the path is normalised the way Envoy's ``normalize_path`` and
``merge_slashes`` do (RFC 3986 dot segments on the decoded path, repeated
slashes merged, encoded slashes decoded), gated as that, and forwarded as that.
"""

from __future__ import annotations

from urllib.parse import quote

from starlette.types import Scope

# Characters a path segment may carry unencoded (RFC 3986 pchar, plus '/').
_SAFE = "/:@!$&'()*+,;=-._~"


def normalized_path(path: str) -> str:
    """``path`` (percent-decoded, as ASGI gives it) with dot segments resolved, slashes merged."""
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    normalized = "/" + "/".join(segments)
    if path.endswith(("/", "/.", "/..")) and segments:
        normalized += "/"
    return normalized


def with_normalized_path(scope: Scope) -> Scope:
    """The scope itself when its path is already normal (the common case), else a copy
    whose ``path`` and ``raw_path`` both carry the normal form."""
    path = scope["path"]
    raw = scope.get("raw_path")
    # ``bytes.find``, not ``in``: a bytes ``in`` first tries the needle as an int and
    # raises (and clears) a TypeError inside: ~1,800 instructions a request.
    if "//" not in path and "/." not in path and (raw is None or raw.find(b"%") < 0):
        return scope
    normalized = normalized_path(path)
    encoded = quote(normalized, safe=_SAFE).encode("ascii")
    if normalized == path and (raw is None or raw == encoded):
        return scope
    return {**scope, "path": normalized, "raw_path": encoded}


def is_normal(path: str) -> bool:
    """Whether a request for ``path`` whose ``raw_path`` is ``path`` itself, encoded (or
    absent), is left as it is by ``with_normalized_path``: so a router may match such a
    request on its path and raw_path alone, without calling it."""
    return (
        path.isascii()
        and normalized_path(path) == path
        and "/." not in path
        and quote(path, safe=_SAFE) == path
    )
