"""The planner's simulator (planner/simulator.py) against cases worked out by hand.

The profile of these cases: a prefill runs 100 prompt tokens/s at every length (a prompt of n tokens takes n/100 s);
a decode step takes 0.1 s for one request and 0.2 s for two, at any context; the KV pool is not a limit.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pdcluster.common.capacity import DecodePoint, PrefillPoint, Profile
from planner.sim_policies import Oracle, Static
from planner.simulator import Phase, Simulator, Trace
from planner.sizing import Split

PROFILE = Profile(
    model="hand", hardware="none", measured_at=datetime(2026, 12, 1, tzinfo=UTC), method="by hand",
    prefill=(PrefillPoint(prompt_tokens=10, tokens_per_s=100), PrefillPoint(prompt_tokens=1000, tokens_per_s=100)),
    decode=tuple(DecodePoint(batch=b, context_tokens=c, itl_s=0.1 * b) for b in (1, 2) for c in (10, 1000)))


def test_two_workers_three_requests_by_hand():
    """1 prefill + 1 decode; TTFT bound 2 s, ITL bound 0.15 s; trace of 10 s.

    A arrives at 0.0 (100 prompt tokens, 31 answer tokens: 30 decode steps), B at 0.5 (200, 6: 5 steps), C at 4.0
    (30, 2: 1 step).
    - Prefill: A 0.0-1.0; B waits for it, 1.0-3.0; C 4.0-4.3.
    - Decode: A alone from 1.0 at 0.1 s a step: 20 steps by 3.0, 10 left. B joins at 3.0: two at 0.2 s a step. B's
      5 steps end at 4.0, when A has 5 left. A alone again from 4.0: 3 steps by 4.3, 2 left. C joins at 4.3: its one
      step ends at 4.5, A's next too (1 left); A alone: done at 4.6.
    - A: TTFT 1.0, mean ITL (4.6 - 1.0) / 30 = 0.12: good. B: TTFT 3.0 - 0.5 = 2.5: misses TTFT. C: TTFT 0.3, mean
      ITL 0.2 / 1 = 0.2: misses ITL.
    - One good request of three: 1 / (2 workers x 10 s) = 0.05 per worker per second.
    """
    trace = Trace("hand", ((0.0, 100, 31), (0.5, 200, 6), (4.0, 30, 2)), 10.0, (Phase("all", 0.0, 10.0),))
    result = Simulator(PROFILE, 2, ttft_bound=2.0, itl_bound=0.15).run(trace, Static(Split(1, 1)))
    a, b, c = result.requests
    assert (a.first_token, b.first_token, c.first_token) == pytest.approx((1.0, 3.0, 4.3))
    assert (a.done, b.done, c.done) == pytest.approx((4.6, 4.0, 4.5))
    assert (a.ttft, b.ttft, c.ttft) == pytest.approx((1.0, 2.5, 0.3))
    assert (a.mean_itl, b.mean_itl, c.mean_itl) == pytest.approx((0.12, 0.2, 0.2))
    assert result.good == [True, False, False]
    assert result.goodput == pytest.approx(0.05)
    assert result.phase_goodput == {"all": pytest.approx(0.05)}
    assert (result.changes, result.flips) == (0, 0)


def test_a_flip_drains_then_serves_in_the_new_role_after_the_flip_time():
    """2P1D, then 1P2D from t=1 (flip 5 s); TTFT bound 2 s, ITL bound 0.15 s.

    R1 arrives at 0.5 (100, 11): prefill 0 (the first of two idle ones) 0.5-1.5. At 1.0 the least loaded prefill
    (prefill 1, idle) is moved: it flips 1.0-6.0. R2 arrives at 1.2 (150, 11): prefill 1 no longer takes work, so it
    waits for prefill 0: 1.5-3.0, TTFT 1.8 (with prefill 1 still serving it would have been 1.5). R3 arrives at 6.5
    (100, 11): prefill 0, 6.5-7.5, then to one of two idle decodes. Every answer alone: 10 steps of 0.1 s.
    """
    trace = Trace("flip", ((0.5, 100, 11), (1.2, 150, 11), (6.5, 100, 11)), 10.0, (Phase("all", 0.0, 10.0),))
    simulator = Simulator(PROFILE, 3, ttft_bound=2.0, itl_bound=0.15, flip_seconds=5.0)
    result = simulator.run(trace, Oracle([(0.0, Split(2, 1)), (1.0, Split(1, 2))], interval=1.0))
    assert [r.ttft for r in result.requests] == pytest.approx([1.0, 1.8, 1.0])
    assert [r.mean_itl for r in result.requests] == pytest.approx([0.1, 0.1, 0.1])
    assert (result.changes, result.flips) == (1, 1)
    assert result.splits == [(0.0, "2P1D"), (1.0, "1P2D")]
    assert [w.role for w in simulator.workers] == ["prefill", "decode", "decode"]
    assert result.good == [True, True, True]


def test_the_last_active_worker_of_a_role_is_never_moved():
    trace = Trace("none", (), 5.0, (Phase("all", 0.0, 5.0),))
    simulator = Simulator(PROFILE, 2, ttft_bound=2.0, itl_bound=0.15)
    result = simulator.run(trace, Oracle([(0.0, Split(1, 1)), (1.0, Split(0, 2))], interval=1.0))
    assert (result.changes, result.flips) == (0, 0)
    assert [w.role for w in simulator.workers] == ["prefill", "decode"]


def test_an_unmeasured_flip_takes_the_stated_default():
    from planner.simulator import DEFAULT_FLIP_SECONDS

    assert Simulator(PROFILE, 2, 1.0, 1.0).flip_seconds == DEFAULT_FLIP_SECONDS
    assert Simulator(PROFILE.model_copy(update={"flip_seconds": 0.7}), 2, 1.0, 1.0).flip_seconds == 0.7


def test_a_busy_worker_drains_its_own_work_before_it_flips():
    """2P1D, then 1P2D from t=1 (flip 5 s). R1 (100 tokens) arrives at 0.5: prefill 0, 0.5-1.5. R2 (150) at 0.6:
    prefill 1 (nothing booked), 0.6-2.1. At 1.0 prefill 0 has less booked (100 < 150): it drains, finishes R1 at
    1.5, flips 1.5-6.5. R3 (100) at 1.2 waits for prefill 1: 2.1-3.1, TTFT 1.9."""
    trace = Trace("drain", ((0.5, 100, 2), (0.6, 150, 2), (1.2, 100, 2)), 10.0, (Phase("all", 0.0, 10.0),))
    simulator = Simulator(PROFILE, 3, ttft_bound=2.0, itl_bound=0.15, flip_seconds=5.0)
    result = simulator.run(trace, Oracle([(0.0, Split(2, 1)), (1.0, Split(1, 2))], interval=1.0))
    assert [r.first_token for r in result.requests] == pytest.approx([1.5, 2.1, 3.1])
    assert [w.role for w in simulator.workers] == ["decode", "prefill", "decode"]


def test_a_decode_never_runs_a_batch_larger_than_measured():
    """1P1D; three requests at 0 of 10 prompt tokens (0.1 s each) and 11 answer tokens (10 steps). R1 decodes from
    0.1, alone for one step; R2 joins at 0.2 (two at 0.2 s a step): R1's 9 steps left end at 2.0, R2 has 1 left.
    R3, prefilled at 0.3, waits for room (2 is the largest batch measured): admitted at 2.0, TTFT 2.0. R2 ends at
    2.2; R3 takes one step at 0.2 s, then 9 alone at 0.1 s: done at 3.1."""
    trace = Trace("full", ((0.0, 10, 11), (0.0, 10, 11), (0.0, 10, 11)), 10.0, (Phase("all", 0.0, 10.0),))
    result = Simulator(PROFILE, 2, ttft_bound=2.0, itl_bound=0.15).run(trace, Static(Split(1, 1)))
    assert [r.first_token for r in result.requests] == pytest.approx([0.1, 0.2, 2.0])
    assert [r.done for r in result.requests] == pytest.approx([2.0, 2.2, 3.1])
