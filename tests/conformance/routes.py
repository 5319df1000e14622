"""Every HTTP route and websocket an engine's API server registers, read from its source.

The routers are read as text (``ast``), not imported: vLLM and SGLang register routes
conditionally (on the model's tasks, on flags), and the census wants every door the
release can open, whichever a given deployment opens. A path given as
``os.environ.get(NAME, "/default")`` is read as its default.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "options", "websocket"}
_WITH_METHODS = {"api_route", "add_api_route"}
_WEBSOCKETS = {"websocket", "add_api_websocket_route", "add_websocket_route"}


@dataclass(frozen=True, order=True)
class Route:
    path: str
    methods: frozenset[str]  # WEBSOCKET for a websocket
    where: str  # file:line, for the census's failure message


def routes_in(root: Path, prefix: str) -> list[Route]:
    """The routes registered by the Python files under ``root`` (``prefix``: how the
    failure message names the package)."""
    found = []
    for file in sorted(root.rglob("*.py")):
        tree = ast.parse(file.read_text("utf-8"), str(file))
        for node in ast.walk(tree):
            route = _route(node, f"{prefix}/{file.relative_to(root)}")
            if route is not None:
                found.append(route)
    return found


def _route(node: ast.AST, where: str) -> Route | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    name = node.func.attr
    if name not in _DECORATORS | _WITH_METHODS | _WEBSOCKETS:
        return None
    first = node.args[0] if node.args else _keyword(node, "path")
    path = _path(first)
    if path is None:
        return None
    if name in _WEBSOCKETS:
        methods = frozenset({"WEBSOCKET"})
    elif name in _WITH_METHODS:
        listed = _keyword(node, "methods")
        names = [e.value for e in getattr(listed, "elts", ()) if isinstance(e, ast.Constant)]
        methods = frozenset(str(m).upper() for m in names) or frozenset({"GET"})
    else:
        methods = frozenset({name.upper()})
    return Route(path, methods, f"{where}:{node.lineno}")


def _keyword(node: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def _path(node: ast.expr | None) -> str | None:
    """A literal path, or the default of ``os.environ.get(NAME, "/path")``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if node.value.startswith("/") else None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and len(node.args) == 2
    ):
        return _path(node.args[1])
    return None
