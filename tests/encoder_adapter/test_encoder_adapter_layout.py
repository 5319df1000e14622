"""encoder_adapter/'s layout holds: every module imports alone, and no two import each other.

Each module is imported in a fresh interpreter, so an import that only works because
another module happened to be loaded first fails here. The module graph is read with
``ast``, imports inside functions included: a lazy import is how the old
ray_client <-> ray_serve cycle hid. Only explicit imports are edges (importing
``a.b.c`` also runs ``a.b``'s ``__init__``, which is not a cycle of ours).
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import modalgate.encoder_adapter

PACKAGE = "modalgate.encoder_adapter"
ROOT = Path(modalgate.encoder_adapter.__file__).parent
# The modules that need torch to import; every other one imports without torch,
# transformers or Ray, so the gateway, the CLI and a Ray client stay light.
NEEDS_TORCH = {
    f"{PACKAGE}.kimi.checkpoint",
    f"{PACKAGE}.kimi.layout",
    f"{PACKAGE}.kimi.preprocess",
    f"{PACKAGE}.kimi.tower",
    f"{PACKAGE}.qwen.adapter",
    f"{PACKAGE}.qwen.tower",
    f"{PACKAGE}.towers.vision_tower",
}
HEAVY = ("torch", "transformers", "ray")


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (a package by its ``__init__``)."""
    names = {}
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((package, *parts))] = file
    return names


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its body."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        is_package = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text("utf-8"), str(file))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import sub`` names the submodule when there is one.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_the_module_graph_is_acyclic() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 20  # the walk found the package, subpackages included
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle
    # The Ray client and the replica side meet in the contract, not in each other.
    client, serve = f"{PACKAGE}.ray.client", f"{PACKAGE}.ray.serve"
    assert serve not in graph[client] and client not in graph[serve]
    assert f"{PACKAGE}.ray.contract" in graph[client] & graph[serve]


def test_a_lazy_import_cycle_is_found(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by an import inside a function is a cycle."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "client.py").write_text("from pkg.sub.serve import thing\n")
    (package / "sub" / "serve.py").write_text(
        "def thing():\n    from pkg import client\n    return client\n"
    )
    graph = import_graph(package, "pkg")
    assert graph["pkg.client"] == {"pkg.sub.serve"}
    assert graph["pkg.sub.serve"] == {"pkg.client"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


@pytest.mark.parametrize("module", sorted(module_names(ROOT, PACKAGE)))
def test_each_module_imports_alone(module: str) -> None:
    probe = f"import sys, {module}; print(*[m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "ray" not in loaded  # Ray loads when a pool is built or called, never on import
    if module not in NEEDS_TORCH:
        assert loaded == set(), f"{module} imports {sorted(loaded)}"


def test_old_and_new_serve_config_files_name_the_same_builder() -> None:
    """``--print-config`` writes the new import path; files written before the move name
    ``ray_serve``, kept as a re-export: both resolve to the one ``app_builder``."""
    from modalgate.encoder_adapter.ray import serve

    written = serve.config_yaml(serve.PoolConfig(spec="kimi:/models/k"))
    new_path = written["applications"][0]["import_path"]
    assert new_path == "modalgate.encoder_adapter.ray.serve:app_builder"
    for import_path in (new_path, "modalgate.encoder_adapter.ray_serve:app_builder"):
        module, _, attribute = import_path.partition(":")
        assert getattr(importlib.import_module(module), attribute) is serve.app_builder
