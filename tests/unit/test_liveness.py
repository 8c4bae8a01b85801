"""Liveness (router/fleet/liveness.py): a worker that stops answering, or whose scheduler is stuck (its /health waits
while its load snapshot stands still), is judged hung within the thresholds and live again once it answers: the verdict,
on a fake clock. Through the whole router, with fake workers: test_liveness_router.py."""

from __future__ import annotations

from pdcluster.common.protocol import Role
from router.config import RouterConfig
from router.fleet.liveness import (
    DEFAULT_SECONDS_PER_TOKEN,
    SAFETY,
    Liveness,
    read_prefill_totals,
    read_running,
    read_snapshot,
    silent_tokens,
)
from router.fleet.workers import Worker

CONFIG = RouterConfig(liveness_interval=1.0, liveness_timeout=5.0, stall_timeout=6.0)


def snapshot(stamp: float) -> dict:
    return {"loads": [{"timestamp": stamp, "num_running_reqs": 1, "num_waiting_reqs": 0}]}


# ----- the verdict, on a fake clock -----

def test_a_worker_that_answers_is_live_and_one_silent_past_the_timeout_is_hung():
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(1.0, read_snapshot(snapshot(100.0)))
    assert live.verdict(5.9, CONFIG) == ""
    assert live.verdict(6.1, CONFIG) == "no answer to liveness probes for 5.1s"
    live.answered(6.2, read_snapshot(snapshot(100.0)))  # answers again: live at once
    assert live.verdict(6.3, CONFIG) == ""


def test_health_waiting_while_the_snapshot_stands_still_is_a_stalled_scheduler():
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(1.0, read_snapshot(snapshot(100.0)))
    live.health_sent(2.0)  # SGLang's /health generation waits in the scheduler from t=2
    for t in range(2, 9):  # the HTTP side answers, the scheduler publishes nothing new
        live.answered(float(t), read_snapshot(snapshot(100.0)))
        assert live.verdict(float(t), CONFIG) == ""
    live.health_sent(5.0)  # a second probe after the first failed: still waiting since t=2
    assert live.verdict(8.5, CONFIG).startswith(
        "scheduler made no progress for 6.5s (/health waiting, load snapshot still; allowed 6.0s")
    live.answered(9.0, read_snapshot(snapshot(109.0)))  # SIGCONT: it publishes
    assert live.verdict(9.0, CONFIG) == ""


def test_a_worker_shutting_down_is_judged_by_its_silence_only():
    """A worker that left the registry with our requests open is draining (`docker stop`: its launcher deregisters
    it, SGLang finishes what it has): a still snapshot with /health waiting is how a drain looks between its last
    steps, and its stream must not be cut for it (seen in the compose stop test). Silence still counts."""
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(1.0, read_snapshot(snapshot(100.0)))
    live.health_sent(2.0)
    for t in range(2, 12):
        live.answered(float(t), read_snapshot(snapshot(100.0)))
    assert live.verdict(11.0, CONFIG).startswith("scheduler made no progress")
    assert live.verdict(11.0, CONFIG, shutting_down=True) == ""
    assert live.verdict(16.5, CONFIG, shutting_down=True) == "no answer to liveness probes for 5.5s"


def test_a_slow_health_with_a_moving_snapshot_and_a_still_snapshot_with_health_answering_are_live():
    busy = Liveness(last_answer=0.0, last_progress=0.0)
    busy.health_sent(0.0)  # a long queue: /health waits its turn, but every batch publishes a snapshot
    idle = Liveness(last_answer=0.0, last_progress=0.0)
    for t in range(30):
        busy.answered(float(t), read_snapshot(snapshot(100.0 + t)))
        idle.answered(float(t), read_snapshot(snapshot(100.0)))  # idle: nothing published, ever
        idle.health_sent(float(t))
        idle.health_answered()  # ... and /health answers in a second
        assert busy.verdict(float(t), CONFIG) == "" and idle.verdict(float(t), CONFIG) == ""


def test_a_long_prompt_in_flight_gives_the_scheduler_its_time_and_no_more():
    """One forward pass of a 3000-token prompt takes ~15 s on a CPU, in silence; with nothing in flight, silence
    past stall_timeout is a stuck scheduler. The worker's own prefill cost per token comes from its snapshots."""
    live = Liveness(last_answer=0.0, last_progress=0.0)
    totals = (5_000_000.0, 1000)  # SGLang says: 5 s spent prefilling 1000 tokens, 5 ms a token
    live.answered(0.0, read_snapshot(snapshot(100.0)), totals)
    live.health_sent(0.0)
    for t in range(1, 50):
        live.answered(float(t), read_snapshot(snapshot(100.0)), totals)
        assert live.verdict(float(t), CONFIG, pending_tokens=3000) == ""  # allowed 6 + 3 x 0.005 x 3000 = 51 s
    assert live.verdict(52.0, CONFIG, pending_tokens=3000).startswith("scheduler made no progress for 52.0s")
    assert live.verdict(7.0, CONFIG, pending_tokens=0).startswith("scheduler made no progress for 7.0s")


def test_a_prefill_shared_with_other_routers_gets_one_whole_forward_pass_whatever_this_router_sent():
    """Routers sharing a prefill (the chart runs two) cannot see each other's prompts: while another router's
    3000-token prompt is in a 15 s forward pass, this one has nothing in flight there and its /health waits. The
    prefill's largest forward pass (its chunked prefill size, registered) is what it may be silent for; a decode,
    and a static worker that did not register it, are judged by what this router sent them."""
    prefill = Worker("p", Role.PREFILL, "http://p", forward_tokens=4096)
    assert silent_tokens(prefill) == 4096  # nothing of ours in flight
    prefill.pending_prompt_tokens = 9000  # ours: chunks of at most 4096, a snapshot after each
    assert silent_tokens(prefill) == 4096
    decode = Worker("d", Role.DECODE, "http://d", forward_tokens=4096)
    decode.pending_prompt_tokens = 7
    static = Worker("s", Role.PREFILL, "http://s", static=True)
    static.pending_prompt_tokens = 300
    assert (silent_tokens(decode), silent_tokens(static)) == (7, 300)

    live = Liveness(last_answer=0.0, last_progress=0.0)
    totals = (5_000_000.0, 1000)  # 5 ms a prompt token: a 4096-token pass is allowed 6 + 3 x 0.005 x 4096 = 67 s
    live.answered(0.0, read_snapshot(snapshot(100.0)), totals)
    live.health_sent(0.0)
    idle_here = Worker("p", Role.PREFILL, "http://p", forward_tokens=4096)  # this router has nothing on it
    for t in range(1, 67):
        live.answered(float(t), read_snapshot(snapshot(100.0)), totals)
        assert live.verdict(float(t), CONFIG, silent_tokens(idle_here)) == ""
    assert live.verdict(68.0, CONFIG, 4096).startswith("scheduler made no progress for 68.0s")


def snapshot_of(stamp: float, running: int) -> dict:
    return {"loads": [{"timestamp": stamp, "num_running_reqs": running, "num_waiting_reqs": 0}]}


def feed(live: Liveness, t: float, stamp: float, running: int) -> None:
    payload = snapshot_of(stamp, running)
    live.answered(t, read_snapshot(payload), None, read_running(payload))


def test_a_decode_with_slow_steps_may_be_as_silent_as_it_was_between_its_snapshots():
    """bench.cluster on SmolLM2: decode steps of ~1 s with 6 streams, a snapshot every 15 steps, and a /health that
    waited past 6 s: the healthy decode was ejected and its 6 streams ended. What it was seen to take between two
    snapshots while busy (15 s here) is what it may be silent for, x SAFETY; a decode with fast steps is still
    judged at stall_timeout, and neither an idle gap nor a gap that ended while it was hung counts."""
    slow = Liveness(last_answer=0.0, last_progress=0.0)
    for publish in range(4):  # busy: a snapshot every 15 s
        feed(slow, 15.0 * publish, 100.0 + 15 * publish, running=6)
    assert slow.busy_gap == 15.0
    slow.health_sent(45.0)
    for t in range(46, 45 + 51):
        slow.answered(float(t), slow.stamps)
        assert slow.verdict(float(t), CONFIG) == ""  # 6 + 3 x 15 = 51 s allowed
    assert slow.verdict(97.0, CONFIG).startswith("scheduler made no progress for 52.0s")
    assert "3x its longest gap between snapshots while busy, 15.0s" in slow.verdict(97.0, CONFIG)

    fast = Liveness(last_answer=0.0, last_progress=0.0)
    for i in range(20):
        feed(fast, 0.5 * i, 100.0 + i, running=2)
    feed(fast, 10.0, 130.0, running=0)  # the requests finished: the idle transition publishes
    feed(fast, 300.0, 140.0, running=1)  # idle for 290 s: not a busy gap
    assert fast.busy_gap == 0.5
    fast.health_sent(300.0)
    fast.answered(307.5, fast.stamps)  # its HTTP side answers; the scheduler is stuck
    assert fast.verdict(307.6, CONFIG).startswith("scheduler made no progress for 7.6s")  # allowed 6 + 3 x 0.5

    stopped = Liveness(last_answer=0.0, last_progress=0.0)
    feed(stopped, 0.0, 100.0, running=3)
    stopped.reason = "no answer to liveness probes for 5.1s"  # SIGSTOPped for a minute, then SIGCONT
    feed(stopped, 60.0, 101.0, running=3)
    assert stopped.busy_gap == 0.0
    assert read_running({"loads": [{"num_running_reqs": 2}, {"num_running_reqs": 1}]}) == 3
    assert read_running({"loads": [{"timestamp": 1.0}]}) is None


def test_before_a_worker_has_prefilled_much_its_cost_per_token_is_taken_to_be_high():
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(0.0, None, (1000.0, 3))  # a few tokens of health probes: too little to judge by
    assert live.allowance(CONFIG, 1000) == CONFIG.stall_timeout + SAFETY * DEFAULT_SECONDS_PER_TOKEN * 1000
    assert read_prefill_totals({"loads": [{"total_prefill_busy_us": 10, "total_prefill_uncached_tokens": 2},
                                          {"total_prefill_busy_us": 5, "total_prefill_uncached_tokens": 1}]}) == (15, 3)
    assert read_prefill_totals({"loads": [{"timestamp": 1}]}) is None


def test_snapshots_are_read_from_v1_loads_and_anything_else_is_no_snapshot():
    assert read_snapshot({"loads": [{"timestamp": 1.5}, {"timestamp": 2.5}]}) == (1.5, 2.5)
    assert read_snapshot({"loads": []}) is None
    assert read_snapshot({"detail": "Not Found"}) is None and read_snapshot([1]) is None
