"""Where bench/ runs and writes: the checkout it runs from (`python -m bench.<name>` in the repository's root) and
bench/results/, where every benchmark writes its JSON and picture and bench/tables.py reads them back."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
