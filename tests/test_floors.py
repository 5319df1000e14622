"""The floors job installs what pyproject says is the lowest: every direct dependency
pinned (tests/floors/constraints.py), none left to float to its newest."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "floors"))
import constraints


def test_every_direct_dependency_is_pinned_to_its_floor():
    wanted = {requirement.name.lower() for requirement in constraints.requirements()}
    assert "pydantic" in wanted and len(wanted) >= 15
    pins = dict(pin.split("==") for pin in constraints.floor_pins())
    assert set(pins) == wanted
    assert pins["uvicorn"] == "0.55"  # the extra is dropped: constraints take bare names
    assert pins["starlette"] == "0.37.2"
    assert pins["av"] == "16"


def test_a_requirement_without_a_floor_is_refused(monkeypatch, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["httpx>=0.27", "orjson"]\n')
    monkeypatch.setattr(constraints, "PYPROJECT", pyproject)
    with pytest.raises(SystemExit, match="'orjson': the floors job needs exactly one '>=' floor"):
        constraints.floor_pins()
