"""bench/README.md's result tables are what bench/tables.py renders from bench/results/ now: a re-run that rewrites a
results file, or an edit of a table by hand, fails here until `python -m bench.tables` renders them again."""

from __future__ import annotations

from bench import tables


def test_the_readmes_tables_are_rendered_from_the_results_files():
    text = tables.README.read_text()
    marked = tables.BLOCK.findall(text)
    assert len(marked) >= 10, "bench/README.md lost its table markers"
    assert tables.render(text) == text, "bench/README.md's tables are stale: run `python -m bench.tables`"


def test_every_known_table_is_in_the_readme():
    shown = {m.group("name") for m in tables.BLOCK.finditer(tables.README.read_text())}
    assert shown == set(tables.TABLES), f"rendered but not shown: {sorted(set(tables.TABLES) - shown)}"


def test_a_stale_table_is_replaced():
    stale = "<!-- table: decode-only -->\n| made up |\n<!-- end table -->\n"
    assert "made up" not in tables.render(stale) and "output tokens/s" in tables.render(stale)
