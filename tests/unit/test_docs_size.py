"""The project's Markdown stays short enough to be read: all of it (every `*.md` file git tracks) under 20,000 words,
counted as `wc -w` counts them (whitespace-separated). A fact belongs in one place, linked from the others; history is
in git. Its relative links are checked in tests/unit/test_docs_config.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_WORDS = 20_000


def tracked_markdown() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in out.splitlines()]


def test_the_markdown_totals_under_20000_words():
    words = {str(p.relative_to(REPO)): len(p.read_bytes().split()) for p in tracked_markdown()}
    assert len(words) > 5, "git ls-files found no Markdown"
    total = sum(words.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(words.items(), key=lambda kv: -kv[1])[:8])
    assert total < MAX_WORDS, f"the Markdown has {total} words (limit {MAX_WORDS}); the largest: {largest}"
