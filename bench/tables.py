"""bench/README.md's result tables, rendered from the results files under bench/results/ so that they cannot go
stale: each table sits between `<!-- table: NAME -->` and `<!-- end table -->`, and NAME is a key of TABLES.

`python -m bench.tables` rewrites the README's tables from the results files; `--check` only says whether they
differ (tests/unit/test_bench_tables.py fails when they do). Each benchmark lays out its own tables (the `readme_*`
functions of its report module) from the numbers it derived and stored; this only says which goes where.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from bench.cluster import decode_only
from bench.cluster import report as cluster
from bench.harness.markdown import sourced
from bench.harness.paths import REPO
from bench.kv_handoff import report as kv_handoff
from bench.overload import report as overload
from bench.pd import report as pd
from bench.persistence import report as persistence
from bench.planner import flip, live
from bench.router import report as router
from bench.routing import report as routing
from bench.store import report as store
from bench.tracing import cost as tracing_cost
from bench.tracing import instructions as tracing_instructions

README = REPO / "bench" / "README.md"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n).*?(<!-- end table -->)", re.S)

TABLES: dict[str, Callable[[], str]] = {
    "router": router.readme_table,
    "persistence-llama-small": lambda: persistence.readme_table("persistence-llama-small.json"),
    "persistence-smollm2-sealed-8k": lambda: persistence.readme_table("persistence-smollm2-sealed-8k.json"),
    "pd": lambda: pd.readme_table("pd.json"),
    "pd-verdicts": pd.readme_verdicts,
    "cluster-ratios": lambda: cluster.readme_ratios("cluster.json"),
    "idle": cluster.readme_idle,
    "decode-only": decode_only.readme_table,
    "kv-handoff": kv_handoff.readme_table,
    "routing": routing.readme_table,
    "routing-decision": routing.readme_decision,
    "routing-restarts": routing.readme_restarts,
    "tracing-cost": lambda: sourced("tracing-cost.json", tracing_cost.table),
    "tracing-instructions": lambda: sourced("tracing-instructions.json", tracing_instructions.table),
    "store": lambda: sourced("store.json", store.table),
    "flip": lambda: sourced("flip.json", flip.readme_line),
    "planner-live": lambda: sourced("planner-live.json", live.readme_line),
    "overload": overload.readme_table,
}


def render(text: str) -> str:
    """The README's text with every marked table rendered again from its results file."""
    def one(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise KeyError(f"bench/README.md marks a table {name!r} that bench/tables.py does not know")
        return f"{match.group(1)}{TABLES[name]()}\n{match.group(3)}"
    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = README.read_text()
    new = render(text)
    if "--check" in argv:
        print("bench/README.md's tables are up to date" if new == text else "bench/README.md's tables are stale")
        return 0 if new == text else 1
    README.write_text(new)
    print(f"rendered {len(BLOCK.findall(new))} tables into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
