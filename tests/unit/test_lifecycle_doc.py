"""docs/lifecycle.md names each step of a request as `file:function`: every one must exist, so that the page is
renamed with the code. And the router's code and that page speak of the code, not of the tracker: no issue numbers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "lifecycle.md"
STEP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def defined_names(path: Path) -> set[str]:
    """Qualified names of the functions and classes of a module: `f`, `C`, `C.method`."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return names


def test_every_step_of_the_lifecycle_page_names_a_function_that_exists():
    steps = STEP.findall(PAGE.read_text())
    assert len(steps) >= 20, "the page names each step as `file:function`"
    missing = [f"{file}:{name}" for file, name in steps
               if not (ROOT / file).is_file() or name not in defined_names(ROOT / file)]
    assert not missing, f"docs/lifecycle.md names what does not exist: {missing}"


def test_the_lifecycle_page_is_the_first_link_of_the_readme_documentation():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Documentation"):]
    first = re.search(r"\[([^\]]+)\]\(([^)]+)\)", table)
    assert first is not None and first.group(2) == "docs/lifecycle.md"


# This project's tracker: "issue 34", "#34". Another project's issue, named with it ("sglang #26747", "owner/repo#1"),
# is a citation of a fact, and stays.
ISSUE = re.compile(r"\bissues? #?\d+|(?<![\w/&])(?<!\w )#\d+\b", re.IGNORECASE)


def test_no_issue_numbers_in_the_router_or_its_lifecycle_page():
    files = [*sorted((ROOT / "router").rglob("*.py")), PAGE]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not found, found
