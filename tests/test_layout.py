"""The tree's layout holds: benchmarks measure, tests test, and no test stands on a
benchmark's code (the corpora both use live under tests/corpora)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

BENCHMARK_MODULES = {path.stem for path in (REPO_ROOT / "benchmarks").glob("*.py")}


def test_no_test_imports_from_benchmarks():
    offenders = []
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue  # this test names the folder to look for it
        tree = ast.parse(path.read_text("utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module.split(".")[0]]
            offenders += [
                f"{path.relative_to(REPO_ROOT)}: {n}" for n in names if n in BENCHMARK_MODULES
            ]
            if isinstance(node, ast.Constant) and node.value == "benchmarks":
                offenders.append(f"{path.relative_to(REPO_ROOT)}: a path into benchmarks/")
    assert offenders == []
