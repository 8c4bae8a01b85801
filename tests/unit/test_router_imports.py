"""The router's modules import each other without a cycle, so that any of them can be imported first (as
`python -m router` imports router.config) whatever the order. Read from the source: every import, also one inside
a function (a late import only hides a cycle), but those under `if TYPE_CHECKING:` (they never run)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module, known: set[str]) -> set[str]:
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):  # in functions too: a late import only hides a cycle until it runs
            if isinstance(inner, ast.Import):
                found.update(alias.name for alias in inner.names)
            elif isinstance(inner, ast.ImportFrom) and inner.module:
                found.add(inner.module)
                found.update(f"{inner.module}.{alias.name}" for alias in inner.names)
    return found & known


def test_router_modules_import_no_cycle():
    files = {module_name(p): p for p in (ROOT / "router").rglob("*.py")}
    graph = {name: runtime_imports(ast.parse(path.read_text()), set(files)) - {name} for name, path in files.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError(f"import cycle: {' -> '.join([*path[path.index(name):], name])}")
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_router_config_imports_first_in_a_fresh_interpreter():
    subprocess.run([sys.executable, "-c", "import router.config"], cwd=ROOT, check=True)
