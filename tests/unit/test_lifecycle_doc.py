"""docs/lifecycle.md walks one streamed chat through the router under the shipped policies, each step named as
`file:function`: every one must exist, so that the page is renamed with the code. And the page and that request agree
both ways, by a profiled request, not a list kept by hand: every router file it runs code in is named on the page, and
every router file the page names ran, but for those of its "Only when needed" list (which must not have).
And the router's code and that page speak of the code, not of the tracker: no issue numbers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "lifecycle.md"
STEP = re.compile(r"`([\w/]+\.py):([\w.]+)`")
PATH = re.compile(r"`((?:\w+/)+[\w.-]+\.\w+)`")  # a file named without a function (not a step)
ONLY_WHEN_NEEDED = "## Only when needed"


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


def page_files() -> tuple[set[str], set[str]]:
    """The router files the page names as steps (`file:function` anywhere but its "Only when needed" list), and
    those of that list."""
    page = PAGE.read_text()
    assert ONLY_WHEN_NEEDED in page, f"docs/lifecycle.md has no {ONLY_WHEN_NEEDED!r} section"
    section = page[page.index(ONLY_WHEN_NEEDED):]
    end = section.find("\n## ", 1)
    needed = {file for file, _ in STEP.findall(section[:end] if end >= 0 else section) if file.startswith("router/")}
    named = {file for file, _ in STEP.findall(page) if file.startswith("router/")}
    return named - needed, needed


def test_every_step_of_the_lifecycle_page_names_a_function_that_exists():
    page = PAGE.read_text()
    steps = STEP.findall(page)
    assert len(steps) >= 20, "the page names each step as `file:function`"
    missing = [f"{file}:{name}" for file, name in steps
               if not (ROOT / file).is_file() or name not in defined_names(ROOT / file)]
    assert not missing, f"docs/lifecycle.md names what does not exist: {missing}"
    gone = [path for path in PATH.findall(page) if not (ROOT / path).is_file()]
    assert not gone, f"docs/lifecycle.md names files that do not exist: {gone}"


def test_the_lifecycle_page_is_the_first_link_of_the_readme_documentation():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Documentation"):]
    first = re.search(r"\[([^\]]+)\]\(([^)]+)\)", table)
    assert first is not None and first.group(2) == "docs/lifecycle.md"


# This project's tracker: the word issue and a number, or a bare "#" and a number. Another project's issue, named
# with it ("sglang #26747", "owner/repo#1"), is a citation of a fact, and stays.
ISSUE = re.compile(r"\bissues? #?\d+|(?<![\w/&])(?<!\w )#\d+\b", re.IGNORECASE)


def test_no_issue_numbers_in_the_router_or_its_lifecycle_page():
    files = [*sorted((ROOT / "router").rglob("*.py")), PAGE]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not found, found


@pytest.fixture(scope="module")
def ran(demo_model: Path) -> set[str]:
    from tests.unit.lifecycle_trace import files_a_streamed_chat_runs

    return files_a_streamed_chat_runs(demo_model)


def test_the_page_names_every_router_file_the_streamed_chat_runs_code_in(ran: set[str]):
    """Each file of router/ the traced request ran code in is one a newcomer reads: the page names it as a step."""
    assert "router/transport/edge.py" in ran and any(file.startswith("router/kv_routing/") for file in ran), ran
    steps, _ = page_files()
    missing = sorted(ran - steps)
    assert not missing, f"run by the streamed chat but not a step on docs/lifecycle.md: {missing}"


def test_every_file_the_page_names_as_a_step_ran_in_the_streamed_chat(ran: set[str]):
    """A step the request does not take misleads: it is in the "Only when needed" list, or gone from the page; and
    that list names only files the request did not run (those it ran are steps)."""
    steps, needed = page_files()
    assert not sorted(steps - ran), f"named as steps on docs/lifecycle.md, not run: {sorted(steps - ran)}"
    assert needed, f"the {ONLY_WHEN_NEEDED!r} list names no file"
    assert not sorted(needed & ran), f"run by the streamed chat, so steps, not only when needed: {sorted(needed & ran)}"
