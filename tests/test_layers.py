"""The house's floors: the CLI sits above the library and nothing in the library imports it; the
server sits above the engine and nothing in the engine imports it.

Read from the source with `ast` (every `import`, `from ... import`, and `importlib.import_module`
of a literal name, at any depth: a function-level import counts as much as a top-level one).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"
# The library packages below the server: none of them imports `kvtier.server`.
BELOW_SERVER = (
    "alloc",
    "slots",
    "spec",
    "paths",
    "errors",
    "jit",
    "pool",
    "transfer",
    "storage",
    "cache",
    "engine",
)
ENTRY = re.compile(r"kvtier(\.\w+)+:\w+")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports (for `from a import b`, both `a` and `a.b`), and every module a
    string of the form `kvtier.x.y:function` names (a command table's entries)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ENTRY.fullmatch(node.value):
            names.add(node.value.partition(":")[0])
    return names


MODULES = {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_walk_sees_the_imports_it_must_refuse() -> None:
    """The checker itself: it finds the CLI's own imports and the one `kvtier.__main__` makes."""
    assert "kvtier.cli.parser" in MODULES["kvtier.__main__"]
    assert any(is_under(n, "kvtier.server") for n in MODULES["kvtier.cli.serve"])
    assert "kvtier.cli.serve" in MODULES["kvtier.cli.parser"]  # named in COMMANDS, imported by name
    assert len(MODULES) > 100


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not is_under(m, "kvtier.cli")))
def test_no_library_module_imports_the_cli(module: str) -> None:
    if module == "kvtier.__main__":  # `python -m kvtier` is the command
        return
    bad = sorted(n for n in MODULES[module] if is_under(n, "kvtier.cli") or n.startswith("kvtier.cli_"))
    assert not bad, f"{module} imports the command line: {bad}"


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if any(is_under(m, f"kvtier.{p}") for p in BELOW_SERVER))
)
def test_the_engine_and_below_never_import_the_server(module: str) -> None:
    bad = sorted(n for n in MODULES[module] if is_under(n, "kvtier.server"))
    assert not bad, f"{module} imports the server: {bad}"


def test_no_module_is_over_400_lines() -> None:
    """STYLE.md's size rule, for every module: a module over it gives a class fewer jobs (a collaborator
    in its own module), never a class split over files."""
    lengths = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {m: n for m, n in lengths.items() if n > 400}
    assert not over, f"modules over 400 lines: {over}"
