"""Reading a policy file (YAML, TOML or JSON) into a ``Policy``.

Every failure becomes one ``PolicyError`` whose text names the file, the field
and the problem, so ``modalgate check`` and ``serve`` can print it as is.
"""

from __future__ import annotations

import json
import re
import sys
from importlib import resources
from os import PathLike
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from modalgate.errors import path as param_path
from modalgate.policy.models import Policy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUILTIN_NAME = "builtin.yaml"


class PolicyError(Exception):
    """A policy that cannot be used; ``problems`` are ``(field, message)`` pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = [
            f"{source}: {field}: {msg}" if field else f"{source}: {msg}" for field, msg in problems
        ]
        super().__init__("\n".join(lines))


def load_policy(source: str | PathLike[str] | None = None) -> Policy:
    """Load a policy file; ``None`` gives the built-in table."""
    if source is None:
        return parse_policy(_builtin_text(), fmt="yaml", source=f"<builtin {BUILTIN_NAME}>")
    file = Path(source)
    try:
        text = file.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = (
            exc.strerror if isinstance(exc, OSError) and exc.strerror else "not readable as UTF-8"
        )
        raise PolicyError(str(file), [("", f"cannot read the file ({reason})")]) from None
    return parse_policy(text, fmt=_format_of(file), source=str(file))


def parse_policy(text: str, *, fmt: str, source: str = "<policy>") -> Policy:
    data = _parse_document(text, fmt, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(source, [("", "the top level must be a mapping of settings")])
    if data.get("extends") == "builtin":
        data = _on_top_of_builtin(data)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, _problems(exc)) from None


def _builtin_text() -> str:
    return resources.files("modalgate.policy").joinpath(BUILTIN_NAME).read_text("utf-8")


def _on_top_of_builtin(own: dict[str, Any]) -> dict[str, Any]:
    """``extends: builtin``: settings merge field by field; a rule replaces the built-in
    rule of the same name and mode; the file's own rules come first (they win ties)."""
    base = yaml.safe_load(_builtin_text())
    merged = {**base, **own}
    for section in ("limits", "media_urls"):
        if isinstance(own.get(section), dict):
            merged[section] = {**base.get(section, {}), **own[section]}
    rules = own.get("models") or []
    if isinstance(rules, list):
        replaced = {_rule_key(rule) for rule in rules}
        kept = [rule for rule in base.get("models", []) if _rule_key(rule) not in replaced]
        merged["models"] = [*rules, *kept]
    return merged


def _rule_key(rule: Any) -> tuple[str, Any] | None:
    if isinstance(rule, dict) and isinstance(rule.get("name"), str):
        return rule["name"].lower(), rule.get("mode")
    return None


def policy_json_schema() -> dict[str, Any]:
    return Policy.model_json_schema()


def _format_of(file: Path) -> str:
    suffix = file.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix == ".toml":
        return "toml"
    if suffix == ".json":
        return "json"
    raise PolicyError(str(file), [("", "unknown file type: use .yaml, .yml, .toml or .json")])


def _parse_document(text: str, fmt: str, source: str) -> Any:
    try:
        if fmt == "yaml":
            return yaml.safe_load(text)
        if fmt == "toml":
            return tomllib.loads(text)
        if fmt == "json":
            return json.loads(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise PolicyError(source, [("", f"{where}{problem}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(source, [("", f"invalid TOML: {exc}")]) from None
    except json.JSONDecodeError as exc:
        raise PolicyError(
            source, [("", f"line {exc.lineno}, column {exc.colno}: invalid JSON: {exc.msg}")]
        ) from None
    raise PolicyError(source, [("", f"unknown policy format {fmt!r}")])


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    """Field paths as a user wrote them: pydantic's union and validator names are dropped."""
    problems: list[tuple[str, str]] = []
    for error in exc.errors(include_url=False, include_input=False):
        loc = [p for p in error["loc"] if isinstance(p, int) or _FIELD_NAME.fullmatch(p)]
        if error["type"] == "duplicate_rule":
            loc += [error["ctx"]["index"], "name"]
        message = error["msg"].removeprefix("Value error, ").replace("valid tuple", "list")
        problem = (param_path(*loc), message)
        if problem not in problems:
            problems.append(problem)
    return problems
