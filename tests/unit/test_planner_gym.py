"""The planner gym's harness (bench/planner/): seeded traces sized to the fleet, the oracle's phases taken alone, every
policy scored, and the targets' verdicts; on the committed profile, with simulated hours of a few minutes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.planner import gym, traces
from bench.planner.__main__ import table, targets
from pdcluster.common.capacity import Profile
from planner.config import PlannerConfig
from planner.simulator import Phase, Trace

REPO = Path(__file__).resolve().parents[2]
PROFILE = Profile.load(REPO / "configs" / "profiles" / "smollm2-135m-instruct.json")
CONFIG = PlannerConfig.from_file(REPO / "configs" / "planner.yaml").model_copy(update={"mode": "act"})


def test_traces_are_seeded_and_sized_to_the_fleet():
    one = traces.shifting(PROFILE, 8, 0.3, seed=3, hour=600)
    assert one == traces.shifting(PROFILE, 8, 0.3, seed=3, hour=600)
    assert one != traces.shifting(PROFILE, 8, 0.3, seed=4, hour=600)
    assert [p.name for p in one.phases] == ["prompt-heavy 1", "answer-heavy", "prompt-heavy 2"]
    arrivals = [t for t, _, _ in one.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] < one.duration == 1800
    longest = max(p.prompt_tokens for p in PROFILE.prefill)
    assert max(p for _, p, _ in one.requests) <= longest  # never beyond what the profile measured
    eight, sixty_four = (len(traces.steady(PROFILE, n, 0.3, seed=1, hour=600).requests) for n in (8, 64))
    assert 6 < sixty_four / eight < 10  # the rate grows with the fleet


def test_a_phase_alone_starts_at_zero_on_an_empty_fleet():
    trace = Trace("t", ((1.0, 10, 2), (12.0, 20, 3), (25.0, 30, 4)), 30.0, (Phase("a", 0, 10), Phase("b", 10, 30)))
    alone = gym.phase_alone(trace, trace.phases[1])
    assert alone.requests == ((2.0, 20, 3), (15.0, 30, 4))
    assert alone.duration == 20 and alone.phases == (Phase("b", 0.0, 20.0),)


def test_evaluate_scores_every_static_split_the_oracle_and_the_planner():
    trace = traces.shifting(PROFILE, 4, CONFIG.itl.bound_s, seed=1, hour=600)
    cell = gym.evaluate(PROFILE, trace, 4, CONFIG, log=lambda line: None)
    assert set(cell["static"]) == {"1P3D", "2P2D", "3P1D"}
    assert cell["best_static"]["goodput_per_worker"] == max(cell["static"].values())
    assert [t for t, _ in cell["oracle"]["schedule"]] == [0.0, 600.0, 1200.0]
    assert cell["planner"]["splits"][0] == (0.0, "2P2D")  # the planner starts even
    ratio = cell["planner"]["goodput_per_worker"] / cell["best_static"]["goodput_per_worker"]
    assert cell["ratios"]["planner_over_best_static"] == pytest.approx(ratio, abs=1e-3)
    assert "| shifting | 4 |" in table({"cells": {"shifting": {"4": cell}}})


def test_targets_name_what_is_met_and_what_is_not():
    def cell(over_static, over_oracle, per_hour):
        return {"ratios": {"planner_over_best_static": over_static, "planner_over_oracle": over_oracle},
                "planner": {"changes_per_hour": per_hour}}
    verdicts = targets({"shifting": {"4": cell(9, 9, 0), "32": cell(1.6, 0.85, 3)},
                        "steady": {"128": cell(0.94, 1.0, 0.5)}})
    assert [(v["target"], v["met"]) for v in verdicts] == [
        ("shifting x32: planner >= 1.5x best static", True), ("shifting x32: planner >= 0.9x oracle", False),
        ("steady x128: planner >= 0.95x best static", False), ("steady x128: <= 1 change of split an hour", True)]


def test_every_planner_module_says_what_it_owns_within_270_lines():
    import ast

    for path in sorted((REPO / "planner").glob("*.py")):
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{path.name} has no module docstring"
        assert len(text.splitlines()) <= 270, f"{path.name} is over 270 lines"
