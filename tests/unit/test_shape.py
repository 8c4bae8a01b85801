"""The shape of the tree, checked so that it stays: no production module over 270 lines (the limit the reviewer's
issue sets: a longer one holds several ideas; split it by idea), and no reference to our own tracker's issue numbers in
code or docs (say the thing itself: a number means nothing to a reader without the tracker, and nothing once the issue
is closed). The functions' own shape (complexity, branches, statements) is ruff's, configured in pyproject.toml."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("router", "bootstrap", "pdcluster", "prefill", "decode", "planner", "prefill.py", "decode.py")
MAX_LINES = 270
# Production files allowed over the limit, each until it is split: none (an entry for a file back under the limit
# fails too, so the list cannot go stale).
OVER_LIMIT: set[str] = set()

# Our tracker's numbers: the word issue (or issues) followed by a number, with or without "#"; a bare "#" and a
# number in parentheses; an issues/ path with a number. Another project's issue keeps its name before the "#"
# ("SGLang #" and its number, "kvcache-ai/Mooncake#" and its number), which these do not match.
TRACKER_REFERENCE = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)|\bissues/\d+", re.IGNORECASE)
# The whole tree, router/ and docs/architecture.md included (they hold none).
TEXT_FILES = ("*.py", "*.md", "Makefile", "*.toml", "*.yaml", "*.yml", "*.sh", "Dockerfile*")
NOT_OURS = {"models", "node_modules", "build", "dist", "__pycache__"}  # the models' own files, build output


def production_files() -> list[Path]:
    files = []
    for top in PRODUCTION:
        path = REPO / top
        files.extend([path] if path.is_file() else sorted(path.rglob("*.py")))
    return files


def project_text_files() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in NOT_OURS and not d.endswith(".egg-info")]
        found.extend(Path(folder) / name for name in files if any(Path(name).match(p) for p in TEXT_FILES))
    return sorted(found)


def test_no_production_file_over_270_lines():
    files = production_files()
    assert len(files) > 50, "the production packages were not found"
    lengths = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in files}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in OVER_LIMIT}
    assert not too_long, f"over {MAX_LINES} lines (split by idea): {too_long}"
    fit_now = {name for name in OVER_LIMIT if lengths.get(name, 0) <= MAX_LINES}
    assert not fit_now, f"no longer over {MAX_LINES} lines (or gone): remove from OVER_LIMIT: {sorted(fit_now)}"


def test_no_reference_to_our_issue_numbers():
    files = project_text_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".py" for p in files)
    found = []
    for path in files:
        if path == Path(__file__).resolve():
            continue  # the pattern's own examples, below
        name = str(path.relative_to(REPO))
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found.extend(f"{name}:{number}: {m.group()}" for m in TRACKER_REFERENCE.finditer(line))
    assert not found, "say what the issue was about, not its number:\n" + "\n".join(found)


def test_the_pattern_tells_our_issues_from_other_projects():
    ours = ["see issue 25", "Issue #3's targets", "issues 21 and 24", "fixed (#12)", "https://example.org/issues/7"]
    theirs = ["SGLang #23020", "kvcache-ai/Mooncake#1400", "sglang #26747", "restart #1", "an issue the fix left"]
    assert [bool(TRACKER_REFERENCE.search(text)) for text in ours + theirs] == [True] * 5 + [False] * 5
