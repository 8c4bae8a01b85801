"""The checkout's modules import each other without a cycle. Which room may import which is import-linter's job
(`make check`, the contracts in pyproject.toml); a cycle inside one room is this test's.

Read from the source: every import counts, also one inside a function (a late import only hides a cycle until it
runs) and one under `if TYPE_CHECKING:` (a reader follows it all the same). `from package import module` is an
import of that module, not of the package's `__init__`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(names)
            if not names <= known:  # names from the module itself, not only its submodules
                found.add(node.module)
    return found & known


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    files = {module_name(p): p for p in paths}
    return {name: imports(ast.parse(path.read_text()), set(files)) - {name} for name, path in files.items()}


def checkout_modules() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in listed.stdout.split()]


def chains(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """For each module, the longest chain of imports from it (the modules along it); AssertionError on a cycle."""
    longest: dict[str, list[str]] = {}

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            raise AssertionError(f"import cycle: {' -> '.join([*path[path.index(name):], name])}")
        if name not in longest:
            below = [visit(imported, [*path, name]) for imported in sorted(graph[name])]
            longest[name] = [name, *max(below, key=len, default=[])]
        return longest[name]

    for name in sorted(graph):
        visit(name, [])
    return longest


def test_no_module_of_the_checkout_imports_itself_through_others():
    chains(import_graph(checkout_modules()))


def test_a_cycle_is_found_also_through_type_checking_and_function_imports():
    sources = {"router.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.b import B\n",
               "router.b": "def f():\n    from router import a\n"}
    known = set(sources)
    graph = {name: imports(ast.parse(text), known) - {name} for name, text in sources.items()}
    try:
        chains(graph)
    except AssertionError as exc:
        assert "router.a -> router.b -> router.a" in str(exc)
    else:
        raise AssertionError("the cycle was not found")


def test_the_router_config_imports_first_in_a_fresh_interpreter():
    subprocess.run([sys.executable, "-c", "import router.config"], cwd=ROOT, check=True)
