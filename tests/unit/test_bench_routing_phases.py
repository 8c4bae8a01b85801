"""bench.routing.phases: a routing run's timeline from its answers, sent times kept or replayed from bench.routing's
closed loop, and where its TTFT went."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bench.routing import load
from bench.routing import phases as routing_phases
from bench.routing.report import Shape, workload


def answer(prefill: str, ttft: float, seconds: float, computed: int, sent: float | None = None) -> dict:
    out = {"prefill": prefill, "ttft_s": ttft, "seconds": seconds, "prompt_tokens": computed + 100,
           "cached_tokens": 100}
    return out if sent is None else {**out, "sent_s": sent}


def test_the_replay_sends_as_the_closed_loop_did():
    shape = Shape(tenants=2, prefix_tokens=20, question_tokens=3, requests=12, turns=3, open_chats=2)
    requests = workload(shape, seed=1)
    seconds = [0.1 * (1 + i % 3) for i in range(len(requests))]  # steps well above the bound below
    texts = [r.text for r in requests]

    async def timed(client, url, text):
        # The answer says how long it really took, as a real one does: on a loaded machine a sleep overruns, and the
        # replay must follow what happened, not what was asked for. What is left between the two is the event loop's
        # own delay between one answer and the next send, hence a generous bound.
        began = time.perf_counter()
        await asyncio.sleep(seconds[texts.index(text)])
        return {"seconds": time.perf_counter() - began}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "one", timed)
        answers = asyncio.run(load.drive("http://x", texts, 2, [r.after for r in requests]))
    replayed = routing_phases.replay(answers, [r.after for r in requests], 2)
    assert replayed == pytest.approx([a["sent_s"] for a in answers], abs=0.03)
    assert max(replayed) > 0 and any(r.after is not None for r in requests)


def test_the_phases_say_which_prefill_was_busy_when_and_what_a_request_computed_beside_others(tmp_path, capsys):
    answers = [answer("p0", 2.0, 3.0, 600, sent=0.0),  # alone until 3 s
               answer("p0", 2.0, 4.0, 200, sent=3.0), answer("p0", 3.0, 3.5, 300, sent=3.5),  # queued behind it
               answer("p1", 1.0, 1.5, 100, sent=4.0), {"error": "HTTP 503"}]
    run = {"policy": "cache_aware", "repeat": 0, "seconds": 7.0, "answers": answers}
    phases = routing_phases.phases(run, {"shape": {}, "concurrency": 4})
    assert phases["replayed_seconds"] == 7.0 and phases["ttft_p50_s"] == 2.0
    assert phases["ttft_p50_after_cold_start_s"] == 2.0  # the 3 sent after the start
    assert phases["by_prefill"] == {
        "p0": {"requests": 3, "computed_tokens": 1100, "ttft_p50_s": 2.0, "busy_s": 5.5},  # 0-2, 3-6.5
        "p1": {"requests": 1, "computed_tokens": 100, "ttft_p50_s": 1.0, "busy_s": 1.0}}
    assert phases["both_prefills_busy_s"] == 1.0 and phases["decode_busy_s"] == 3.0  # 2-3, 5-7
    assert phases["in_flight"] == pytest.approx((3 + 4 + 3.5 + 1.5) / 7, abs=0.01)
    assert phases["tokens_per_ttft_s"] == {"alone": {"requests": 1, "tokens_per_s": 300.0},
                                           "beside_others": {"requests": 1, "tokens_per_s": 100.0},  # p1's
                                           "sharing_its_prefill": {"requests": 2, "tokens_per_s": 100.0}}
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"settings": {"shape": {}, "concurrency": 4}, "runs": [run]}))
    assert routing_phases.main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "cache_aware"


def test_a_result_without_sent_times_is_replayed_from_its_workload():
    shape = Shape(tenants=2, prefix_tokens=20, question_tokens=3, requests=6)
    answers = [answer("p0", 1.0, 2.0, 10) for _ in range(6)]
    run = {"policy": "prefix", "repeat": 0, "seconds": 6.0, "answers": answers}
    phases = routing_phases.phases(run, {"shape": vars(shape), "concurrency": 2})
    assert phases["replayed_seconds"] == 6.0  # 6 requests of 2 s, 2 at a time
    assert phases["in_flight"] == 2.0
