"""perf_tools reads top-down: no import cycles between its modules (lazy imports included),
and no module over ~600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import perf_tools

PKG = "perf_tools"
ROOT = Path(perf_tools.__file__).parent
MAX_LINES = 600


def _edges() -> dict[str, set[str]]:
    """module -> the perf_tools modules it imports anywhere in its source (the package's
    `__init__` left out: it imports nothing)."""
    modules = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] != PKG:
                    continue
                if len(parts) > 1:
                    deps.add(parts[1])
                else:  # from perf_tools import bench: submodules by name
                    deps |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == PKG and len(parts) > 1:
                        deps.add(parts[1])
        graph[name] = (deps & modules) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def test_the_check_sees_lazy_imports():
    graph = _edges()
    assert "profile" in graph["bench"]  # `bench --profile` imports it inside main()
    assert "bench" not in graph["profile"]
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_no_module_over_the_limit():
    sizes = {p.name: len(p.read_text().splitlines()) for p in ROOT.glob("*.py")}
    assert {n: k for n, k in sizes.items() if k > MAX_LINES} == {}
