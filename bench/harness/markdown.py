"""What bench/README.md's result tables are made of (bench/tables.py renders them): a results file read back from
bench/results/, the line that says where and when it was measured, a Markdown grid, and numbers as the tables print
them. Each benchmark lays out its own tables with these (its report module's `readme_*` functions)."""

from __future__ import annotations

import json
from collections.abc import Callable

from bench.harness.paths import RESULTS


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def grid(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def source(result: dict, name: str) -> str:
    m = result["machine"]
    return f"From `bench/results/{name}` ({m['date_utc'][:10]}, commit `{m['git_commit'][:7]}`):"


def sourced(name: str, layout: Callable[[dict], str]) -> str:
    """A results file laid out by `layout`, after the line that says where and when it was measured."""
    result = load(name)
    return source(result, name) + " " + layout(result)


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def spread(cell: dict | None, fmt: str = ".2f", unit: str = "") -> str:
    """A median over repeats with its range, "-" when there is none."""
    return "-" if not cell else f"{cell['median']:{fmt}}{unit} ({cell['min']:{fmt}}-{cell['max']:{fmt}})"
