"""bench/planner/live.py's arithmetic: the trace is the same for every run, a request meets the SLOs only with both
bounds held, and the verdict needs the planner at least as good as the best static split and following each change."""

from __future__ import annotations

from bench.planner.live import PHASES, judged, summary, trace
from planner.config import PlannerConfig


def test_the_trace_is_seeded_and_phased():
    first, again = trace(60.0, seed=3), trace(60.0, seed=3)
    assert first == again and first != trace(60.0, seed=4)
    assert [t[1] for t in first] == sorted((t[1] for t in first), key=[p.name for p in PHASES].index)
    assert all(len(ids) == next(p.prompt_tokens for p in PHASES if p.name == phase) for _, phase, ids, _ in first)


def test_a_request_meets_the_slos_only_within_both_bounds():
    slo = PlannerConfig()  # TTFT 30 s, ITL 0.3 s
    answers = [{"phase": "prompt-heavy", "status": 200, "ttft_s": 5.0, "itl_s": 0.2},
               {"phase": "prompt-heavy", "status": 200, "ttft_s": 31.0, "itl_s": 0.2},
               {"phase": "answer-heavy", "status": 200, "ttft_s": 1.0, "itl_s": 0.31},
               {"phase": "answer-heavy", "status": 503, "ttft_s": None, "itl_s": None}]
    verdict = judged(answers, slo)
    assert verdict["prompt-heavy"] == {"requests": 2, "failed": 0, "attainment": 0.5}
    assert verdict["answer-heavy"] == {"requests": 2, "failed": 1, "attainment": 0.0}
    assert verdict["all"]["attainment"] == 0.25


def run(name: str, attainment: float, roles: list) -> dict:
    return {"run": name, "judged": {"all": {"attainment": attainment}}, "roles": roles}


def test_the_planner_must_match_the_best_static_split_and_follow_both_changes():
    follows = [(100.0, 2, 1), (160.0, 1, 2), (300.0, 1, 2), (320.0, 2, 1)]
    runs = [run("static 2P1D", 0.5, []), run("static 1P2D", 0.6, []), run("planner from 2P1D", 0.7, follows)]
    verdict = summary(runs, phase_s=150.0, interval=15.0)
    assert verdict["met"] and verdict["followed_each_change"] == [True, True]
    late = [(100.0, 2, 1), (200.0, 1, 2)]  # the first flip 50 s after the change: over 2 intervals (+10 s)
    assert summary([*runs[:2], run("planner from 2P1D", 0.7, late)], 150.0, 15.0)["followed_each_change"] == [False,
                                                                                                               False]
    assert not summary([*runs[:2], run("planner from 2P1D", 0.55, follows)], 150.0, 15.0)["met"]
