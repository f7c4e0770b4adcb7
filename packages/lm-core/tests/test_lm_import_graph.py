"""No import cycles between lm_core's modules, lazy (function-level) imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import lm_core

PKG = "lm_core"


def _edges() -> dict[str, set[str]]:
    """module -> the lm_core modules it imports anywhere in its source (the package's
    `__init__` left out: every module may use the package's public names lazily)."""
    root = Path(lm_core.__file__).parent
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] != PKG:
                    continue
                if len(parts) > 1:
                    deps.add(parts[1])
                else:  # from lm_core import fsdp: a submodule by name
                    deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == PKG and len(parts) > 1:
                        deps.add(parts[1])
        graph[name] = (deps & modules) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
