"""Pin every direct dependency to the lowest version pyproject allows.

CI's main job installs the newest of everything, so a floor nobody raised can be a floor
nobody tested: this prints a pip constraints file (`name==floor`) that the floors job
installs the package under (tests/floors/run.sh). A requirement without a `>=` floor
is an error here, not a silent newest.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject's own marker brings tomli there
    import tomli as tomllib

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirements(extras: tuple[str, ...] = ()) -> list[Requirement]:
    """pyproject's direct dependencies (and the extras named) that apply here."""
    project = tomllib.loads(PYPROJECT.read_text("utf-8"))["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    parsed = [Requirement(line) for line in lines]
    return [r for r in parsed if r.marker is None or r.marker.evaluate()]


def floor_pins(extras: tuple[str, ...] = ()) -> list[str]:
    pins: dict[str, str] = {}
    for requirement in requirements(extras):
        line = str(requirement)
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(floors) != 1:
            raise SystemExit(f"{line!r}: the floors job needs exactly one '>=' floor")
        name = requirement.name.lower()
        if name in pins and pins[name] != floors[0]:
            raise SystemExit(f"{name}: two floors, {pins[name]} and {floors[0]}")
        pins[name] = floors[0]
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


if __name__ == "__main__":
    print("\n".join(floor_pins(tuple(sys.argv[1:]))))
