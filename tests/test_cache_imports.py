"""The cache package's shape: no import cycle between its modules (type-only imports included), none
over 400 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvtier.cache

PACKAGE = "kvtier.cache"
ROOT = Path(kvtier.cache.__file__).parent


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source (under TYPE_CHECKING, in
    functions); `from package import name` counts as an import of `package.name` where that is a
    module, else of the package itself."""
    modules = {package if p.stem == "__init__" else f"{package}.{p.stem}": p for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package
                    base = f"{package}.{base}".rstrip(".") if base else package
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in modules:
                        edges.add(sub)
                    elif base in modules:
                        edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)) is not None:
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None


def test_the_cache_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert graph.get("kvtier.cache.manager")  # the graph was read
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_sees_a_type_only_cycle(tmp_path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
    )
    (tmp_path / "c.py").write_text("def f():\n    from .a import A\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (tmp_path / "c.py").write_text("X = 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_each_module_imports_only_those_the_package_docstring_lists_above_it() -> None:
    listed = re.findall(r"^- `(\w+)\.py`", kvtier.cache.__doc__, flags=re.M)
    modules = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    assert sorted(listed) == sorted(modules)  # every module, once
    at = {f"{PACKAGE}.{m}": i for i, m in enumerate(listed)}
    graph = import_graph()
    upward = [(m, e) for m in at for e in graph[m] if at[e] > at[m]]
    assert upward == []


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.py")), ids=lambda p: p.name)
def test_no_cache_module_is_over_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400
