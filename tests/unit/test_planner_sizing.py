"""The planner's sizing core (planner/sizing.py) and predictors (planner/predict.py), on the hand profile of
test_planner_simulator.py: a prefill runs 100 prompt tokens/s, a decode step takes 0.1 s alone and 0.2 s for two
(the largest batch measured).

Worked out by hand, TTFT p90 within 10 s, ITL p90 within 0.25 s, decode_utilization 0.85:
- prompt-heavy (1 request/s, 500 prompt tokens, 2 answer tokens): a prefill takes 5 s, 5 Erlangs offered, 5 s of
  budget for waiting. Erlang C: 6 prefills wait > 5 s with 0.59 x e^-1 = 0.22 > 0.1; 7 with 0.32 x e^-2 = 0.04: 7
  prefills. Decode: batch 2 meets 0.25 s; 1 x 2 tokens x 0.2 s = 0.4 concurrent over 2 x 0.85 slots: 0.24 decodes.
- answer-heavy (1 request/s, 50 prompt tokens, 200 answer tokens): a prefill takes 0.5 s: 1 prefill. Decode:
  1 x 200 x 0.2 = 40 concurrent over 1.7 slots a decode: 23.5 decodes.
"""

from __future__ import annotations

import pytest

from planner.config import PlannerConfig, Slo
from planner.predict import Load, predict_load, predict_series
from planner.sizing import (
    Observation,
    PlannerState,
    Split,
    best_split,
    corrected,
    decide,
    decode_need,
    erlang_c,
    prefill_need,
)
from tests.unit.test_planner_simulator import PROFILE

CONFIG = PlannerConfig(ttft=Slo(percentile=90, bound_s=10.0), itl=Slo(percentile=90, bound_s=0.25),
                       decode_utilization=0.85, predictor="constant", hysteresis=0.1, dwell_s=600)
PROMPT_HEAVY = Load(requests_per_s=1.0, prompt_tokens=500, answer_tokens=2)
ANSWER_HEAVY = Load(requests_per_s=1.0, prompt_tokens=50, answer_tokens=200)


def test_erlang_c_by_hand():
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # B(2, 1) = 0.2; C = 2 x 0.2 / (2 - 1 x 0.8)
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # one server: the utilization
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0


def test_role_needs_by_hand():
    assert prefill_need(PROFILE, PROMPT_HEAVY, CONFIG.ttft, cap=64) == 7
    assert decode_need(PROFILE, PROMPT_HEAVY, CONFIG.itl, 0.85) == pytest.approx(0.4 / 1.7)
    assert prefill_need(PROFILE, ANSWER_HEAVY, CONFIG.ttft, cap=64) == 1
    assert decode_need(PROFILE, ANSWER_HEAVY, CONFIG.itl, 0.85) == pytest.approx(40 / 1.7)
    assert prefill_need(PROFILE, Load(0.0, 500, 2), CONFIG.ttft, cap=64) == 0


def run(load: Load, current: Split, state: PlannerState | None = None, now: float = 3600.0, **config):
    seen = Observation(load, ttft_met=100, ttft_judged=100, itl_met=100, itl_judged=100)
    return decide(CONFIG.model_copy(update=config), PROFILE, current, state or PlannerState(), [seen], now)


def test_direction_follows_the_mix():
    decision, state = run(PROMPT_HEAVY, Split(4, 4))
    assert decision.desired == Split(7, 1) and decision.changes
    assert decision.reason.startswith("change to 7P1D: 3 to prefill")
    assert state.last_change_at == 3600.0 and state.last_direction == 1
    decision, _ = run(ANSWER_HEAVY, Split(4, 4))
    assert decision.desired == Split(1, 7)
    assert "to decode" in decision.reason


def test_never_below_one_worker_per_role():
    flood = Load(requests_per_s=50.0, prompt_tokens=2000, answer_tokens=1)
    assert run(flood, Split(1, 1))[0].desired == Split(1, 1)
    assert run(flood, Split(4, 4))[0].desired == Split(7, 1)
    assert best_split(2, 100.0, 0.0, Split(1, 1)) == Split(1, 1)
    with pytest.raises(ValueError):
        best_split(1, 1.0, 1.0, Split(1, 0))


def test_hysteresis_holds_a_change_that_buys_too_little():
    # From 4P4D to 7P1D the tighter role goes from 7/4 = 1.75 to 7/7 = 1.0: 0.75 less, 0.43 of itself.
    held, _ = run(PROMPT_HEAVY, Split(4, 4), hysteresis=0.45)
    assert held.desired == Split(4, 4) and not held.changes
    assert "less than the hysteresis (0.45 of it)" in held.reason
    assert run(PROMPT_HEAVY, Split(4, 4), hysteresis=0.4)[0].desired == Split(7, 1)


def test_dwell_holds_a_reversal_but_not_a_move_the_same_way():
    moved_to_prefill = PlannerState(last_change_at=3300.0, last_direction=1)
    # Answer-heavy at 4P4D: the decodes at 23.5 / 4; 1P7D would still overload them (23.5 / 7): no reason to
    # reverse within the dwell.
    held, state = run(ANSWER_HEAVY, Split(4, 4), moved_to_prefill)
    assert not held.changes and "dwell" in held.reason
    assert state.last_change_at == 3300.0  # a hold leaves the clock alone
    assert run(ANSWER_HEAVY, Split(4, 4), moved_to_prefill, now=3300.0 + 601)[0].desired == Split(1, 7)
    assert run(PROMPT_HEAVY, Split(4, 4), moved_to_prefill)[0].desired == Split(7, 1)  # same direction: a ramp


def test_a_reversal_within_the_dwell_when_it_makes_an_overloaded_split_fit():
    # 0.1 requests/s of 50 prompt and 200 answer tokens: 1 prefill; 0.1 x 200 x 0.2 / 1.7 = 2.35 decodes. At 7P1D
    # the one decode is at 2.35; 3P5D fits (prefills 1/3, decodes 2.35/5 = 0.47).
    light_chat = Load(requests_per_s=0.1, prompt_tokens=50, answer_tokens=200)
    decision, state = run(light_chat, Split(7, 1), PlannerState(last_change_at=3300.0, last_direction=1))
    assert decision.desired == Split(3, 5)
    assert "a reversal within the dwell: 7P1D would overload its tighter role, 3P5D not" in decision.reason
    assert state.last_direction == -1


def test_a_steady_load_with_noise_never_flips_once_sized():
    current, state = Split(7, 1), PlannerState()
    for k in range(60):
        noisy = Load(1.0 + 0.05 * (-1) ** k, 500 + 20 * (-1) ** (k // 2), 2)
        decision, state = run(noisy, current, state, now=60.0 * k)
        assert not decision.changes, decision.reason


def test_the_correction_rises_on_a_miss_beyond_chance_and_decays_when_met():
    slo = Slo(percentile=90, bound_s=1.0)  # over 100 requests, chance is 2 x sqrt(0.9 x 0.1 / 100) = 0.06
    assert corrected(1.0, (0.7, 100), slo, CONFIG) == pytest.approx(1.14)  # 1 x (1 + 1.0 x (0.2 - 0.06))
    assert corrected(1.4, (0.5, 100), slo, CONFIG) == 1.5  # capped at max_correction
    assert corrected(1.4, (0.86, 100), slo, CONFIG) == 1.4  # 0.04 short: chance, left alone
    assert corrected(1.4, (0.95, 100), slo, CONFIG) == pytest.approx(1.2)  # met: halfway back to 1
    assert corrected(1.4, None, slo, CONFIG) == 1.4  # nothing judged: nothing learnt


def test_the_correction_reads_settled_intervals_with_enough_requests():
    missed = Observation(PROMPT_HEAVY, ttft_met=50, ttft_judged=100, itl_met=100, itl_judged=100)
    decision, state = decide(CONFIG, PROFILE, Split(4, 4), PlannerState(), [missed], 0.0)
    assert decision.corrections == pytest.approx((1.34, 1.0))  # 0.4 short, 0.34 beyond chance
    assert decision.prefill_need == pytest.approx(7 * 1.34)
    assert state.prefill_correction == pytest.approx(1.34)
    just_changed = PlannerState(last_change_at=-60.0)  # a minute ago; the window is 3 intervals of 60 s
    assert decide(CONFIG, PROFILE, Split(4, 4), just_changed, [missed], 0.0)[0].corrections == (1.0, 1.0)
    few = Observation(PROMPT_HEAVY, ttft_met=0, ttft_judged=10, itl_met=10, itl_judged=10)  # under min_judged
    assert decide(CONFIG, PROFILE, Split(4, 4), PlannerState(), [few], 0.0)[0].corrections == (1.0, 1.0)


def test_every_decision_names_its_inputs_and_reason():
    decision, _ = run(PROMPT_HEAVY, Split(4, 4))
    line = decision.log_line()
    for part in ("split=4P4D", "desired=7P1D", "rps=1.000", "prompt=500", "answer=2", "attained ttft=1.00",
                 "need=7.00P/0.24D", "reason='change to 7P1D"):
        assert part in line, line


def test_predictors():
    values = [1.0, 2.0, 3.0, 4.0]
    assert predict_series(values, "constant", 3) == 4.0
    assert predict_series(values, "moving_average", 3) == pytest.approx(3.0)
    assert predict_series(values, "linear_trend", 3) == pytest.approx(5.0)  # the line through 2, 3, 4, one ahead
    assert predict_series([5.0, 1.0], "linear_trend", 2) == 0.0  # -3 floored at 0
    assert predict_series([], "moving_average", 3) == 0.0
    idle = Load(0.0, 0.0, 0.0)
    assert predict_load([Load(2.0, 100, 10), idle], "moving_average", 3) == Load(1.0, 100, 10)


def test_the_example_config_loads_and_a_bad_one_is_refused(tmp_path):
    from pathlib import Path

    from pydantic import ValidationError

    repo = Path(__file__).resolve().parents[2]
    config = PlannerConfig.from_file(repo / "configs" / "planner.yaml")
    assert config.mode == "recommend" and config.ttft.attainment_target == 0.9
    assert (repo / config.profile).is_file(), "configs/planner.yaml names a profile that is not committed"
    for bad in ("mode: fly\n", "ttft: {percentile: 0, bound_s: 1}\n", "hysteresis: 1.5\n", "interval: 60\n"):
        (tmp_path / "bad.yaml").write_text(bad)
        with pytest.raises(ValidationError):
            PlannerConfig.from_file(tmp_path / "bad.yaml")
