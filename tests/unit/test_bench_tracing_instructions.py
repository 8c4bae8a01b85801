"""bench.tracing.instructions' pure parts: per-round ratios of instructions per request against tracing off, the
floor's share of an untraced request, and the floor's code itself running (valgrind only counts it)."""

from __future__ import annotations

import subprocess
import sys

from bench.tracing import instructions as ti


def cells(per_request: dict[str, list[int]], mode: str = "plain") -> list[dict]:
    return [{"variant": v, "mode": mode, "round": r, "requests": 100, "instructions": n * 100, "per_request": n}
            for v, rounds in per_request.items() for r, n in enumerate(rounds)]


def test_ratios_pair_each_round_with_off_and_the_verdict_is_the_median_against_the_target():
    derived = ti.derive(cells({"off": [1000, 2000], "on": [1200, 2200], "sampled": [1010, 2040]}), ["plain"], 40)
    plain = derived["modes"]["plain"]
    assert plain["ratio_on_per_round"] == [1.2, 1.1] and plain["ratio_on_over_off"] == 1.15
    assert plain["ratio_sampled_per_round"] == [1.01, 1.02]
    assert plain["floor_share_of_off"] == 0.0267 and plain["added_by_tracing"] == 200  # medians: 1700 - 1500
    verdicts = derived["verdicts"]
    assert verdicts["plain, on: instructions on / off <= 1.05"] == {"value": 1.15, "pass": False}
    assert verdicts["plain, sampled: instructions sampled / off <= 1.05"]["pass"] is True


def test_the_table_shows_each_mode_with_its_ratios_and_the_floor():
    result = {"settings": {"rounds": 2, "duration_s": 20, "concurrency": 8},
              "derived": ti.derive(cells({"off": [800_000] * 2, "on": [960_000] * 2, "sampled": [840_000] * 2}),
                                   ["plain"], 36_000)}
    assert "| plain | 800k | 1.20 (+160k) | 1.05 | 1.045 |" in ti.table(result)


def test_the_floor_is_python_that_runs():
    subprocess.run([sys.executable, "-c", ti.FLOOR, "200"], check=True, timeout=60)
