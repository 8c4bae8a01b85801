"""bench.routing's pure parts: its workload is the issue's (tenants' long shared prompts, Zipf popularity, short
questions, made anew per seed), its oracle counts what SGLang could at best reuse, and its report scores the policies
against it with their spread over repeats."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from bench.routing import load
from bench.routing import report as routing_report
from bench.routing.__main__ import main as run_routing
from bench.routing.report import Shape


def test_the_workload_is_tenants_sharing_long_prefixes_with_zipf_popularity():
    shape = Shape(tenants=4, prefix_tokens=200, question_tokens=10, requests=400)
    requests = routing_report.workload(shape, seed=1)
    assert routing_report.workload(shape, seed=1) == requests != routing_report.workload(shape, seed=2)
    popularity = Counter(r.tenant for r in requests)
    assert popularity[0] > popularity[1] > popularity[3] > 0  # 1/1, 1/2, ..., 1/4 of the weight
    for tenant in range(4):
        texts = [r.text for r in requests if r.tenant == tenant]
        shared = texts[0][:texts[0].index("Question")]
        assert len(shared.split()) > 200 and all(t.startswith(shared) for t in texts)
        assert len({t[len(shared):] for t in texts}) == len(texts)  # every question its own
    assert len({r.text.split("Question")[0] for r in requests}) == 4


def test_a_chats_turn_carries_the_chat_so_far_and_is_sent_only_once_the_turn_before_is_answered():
    shape = Shape(tenants=2, prefix_tokens=50, question_tokens=5, requests=40, turns=3, open_chats=2)
    requests = routing_report.workload(shape, seed=3)
    follows = [(i, r.after) for i, r in enumerate(requests) if r.after is not None]
    assert follows and all(before < i and requests[i].text.startswith(requests[before].text) for i, before in follows)
    assert len({r.text.split("Question")[1] for r in requests if r.after is None}) > 2  # new chats, several at once
    sent: list[int] = []
    log: list[tuple[str, int]] = []

    async def answer_later(client, url, text):  # each answer takes a while: a turn sent at once would pass it
        sent.append(texts.index(text))
        log.append(("sent", sent[-1]))
        await asyncio.sleep(0.01)
        log.append(("answered", texts.index(text)))
        return {"text": text}

    texts = [r.text for r in requests]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "one", answer_later)
        answers = asyncio.run(load.drive("http://x", texts, 4, [r.after for r in requests]))
    assert [a["text"] for a in answers] == texts
    assert all(log.index(("answered", before)) < log.index(("sent", i)) for i, before in follows)
    assert sent != list(range(len(texts)))  # a waiting turn let later requests pass it


def test_the_open_loop_sends_at_seeded_arrivals_without_waiting_for_answers_but_a_turn_waits_for_its_chat():
    shape = Shape(tenants=2, prefix_tokens=50, question_tokens=5, requests=30, turns=3, open_chats=2)
    requests = routing_report.workload(shape, seed=3)
    texts, after = [r.text for r in requests], [r.after for r in requests]
    in_flight, most = 0, 0

    async def slow_answer(client, url, text):  # far slower than arrivals: a closed loop of 1 would send one by one
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.2)
        in_flight -= 1
        return {"text": text}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "one", slow_answer)
        answers = asyncio.run(load.drive_open("http://x", texts, 500.0, after, seed=1))
        again = asyncio.run(load.drive_open("http://x", texts, 500.0, after, seed=1))
    assert [a["text"] for a in answers] == texts and most > 4  # arrivals did not wait for answers
    assert [a["due_s"] for a in answers] == [a["due_s"] for a in again]  # the same arrivals for every policy
    assert all(a["sent_s"] >= a["due_s"] for a in answers)
    assert all(answers[i]["sent_s"] >= answers[before]["sent_s"] + 0.2 for i, before in enumerate(after)
               if before is not None)  # a turn only once the one before it was answered


def test_the_oracle_is_the_longest_prefix_shared_with_any_earlier_prompt_as_sglang_reuses_it():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9], [7, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8], [7, 7, 7, 1]]
    assert routing_report.oracle(prompts, page=1) == [0, 6, 0, 7, 3]  # a repeat recomputes its last token
    assert routing_report.oracle(prompts, page=4) == [0, 4, 0, 4, 0]  # whole pages only


def row(policy: str, repeat: int, cached: list[int], ttfts: list[float]) -> dict:
    answers = [{"ttft_s": t, "cached_tokens": c, "prefill": "p0", "predicted": c if policy == "cache_aware" else None}
               for c, t in zip(cached, ttfts, strict=True)]
    return routing_report.run_row(policy, repeat, answers, oracle_cached=100, seconds=1.0)


def test_the_report_scores_each_policy_against_the_oracle_and_round_robin_in_the_same_repeat():
    runs = [row("round_robin", 0, [30, 40], [2.0, 4.0]), row("prefix", 0, [45, 45], [1.5, 2.5]),
            row("cache_aware", 0, [50, 48], [1.0, 1.2]),
            row("round_robin", 1, [40, 40], [3.0, 5.0]), row("prefix", 1, [40, 50], [2.0, 2.0]),
            row("cache_aware", 1, [50, 46], [1.4, 1.6])]
    runs[4]["errors"] = 1
    summary = routing_report.summarize(runs)
    cached = summary["policies"]["cache_aware"]["cached_over_oracle"]
    assert (cached["median"], cached["min"], cached["max"]) == (0.97, 0.96, 0.98)
    assert summary["policies"]["round_robin"]["ttft_p50_s"]["runs"] == [3.0, 4.0]
    paired = summary["ttft_p50_over_round_robin"]["cache_aware"]
    assert paired["runs"] == pytest.approx([1.1 / 3.0, 1.5 / 4.0]) and paired["every_repeat_below_1"]
    verdicts = routing_report.verdicts(summary)
    assert verdicts["cached_over_oracle"]["met"] and verdicts["ttft_p50_over_round_robin"]["met"]
    assert not verdicts["no_errors"]["met"]
    result = {"summary": summary, "verdicts": verdicts}
    assert any(line.startswith("cache_aware: cached/oracle 0.97 (0.96-0.98)") for line in routing_report.lines(result))
    assert runs[2]["predicted_cached_tokens"] == 98 and runs[2]["by_prefill"] == {"p0": 2}


def test_the_picture_is_drawn(tmp_path):
    runs = [row(policy, 0, [50, 50], [1.0, 2.0]) for policy in routing_report.POLICIES]
    summary = routing_report.summarize(runs)
    result = {"runs": runs, "summary": summary, "settings": {"shape": vars(Shape())},
              "machine": {"cpu_count": 2, "date_utc": "2026-01-01T00:00:00Z", "git_commit": "abc"}}
    routing_report.plot(result, tmp_path / "routing.png")
    assert (tmp_path / "routing.png").stat().st_size > 1000


def test_the_dry_run_starts_nothing_and_shows_the_workload_and_its_oracle(demo_model, capsys):
    assert run_routing(["--dry-run", "--quick", "--model", "tiny-llama"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["shape"]["tenants"] == 2 and sum(shown["requests_per_tenant"]) == 12
    assert 0 < shown["oracle_cached_tokens (page 1)"] < shown["prompt_tokens"]


def test_restarts_recovery_is_when_four_answers_in_a_row_hold_nine_tenths_of_steady():
    from bench.routing import restarts

    def answer(ended: float, cached: int, error: bool = False) -> dict:
        return {"ended": ended, "cached_tokens": cached, "prompt_tokens": 100, "error": "x" if error else None}

    answers = [answer(9.0, 90), answer(11.0, 0), answer(12.0, 90), answer(13.0, 0, error=True), answer(14.0, 90),
               answer(15.0, 90), answer(16.0, 90), answer(17.0, 90)]
    # From 10 s on: 0, 90, (failed: not counted), 90, 90, 90 -> the window starting at 12 s averages 0.9 >= 0.9 * 0.9.
    assert restarts.recovery(answers, 10.0, 0.9) == 2.0
    assert restarts.recovery(answers, 10.0, 1.5) is None  # never back
    row = restarts.phase_row("p", answers, {"indexed": 99.0, "blind": 1.0}, 10.0, 0.9)
    assert row["errors"] == 1 and row["blind_share"] == 0.01 and row["seconds_to_recover"] == 2.0
    assert row["hit_ratio"] == round((0.9 * 6) / 7, 4)


def test_chats_carry_their_turns_so_far_and_keep_single_questions_as_they_were():
    single = routing_report.workload(Shape(requests=40), seed=5)
    assert routing_report.workload(Shape(requests=40, turns=1), seed=5) == single
    chats = routing_report.workload(Shape(requests=40, turns=3), seed=5)
    assert [r.tenant for r in chats] == [r.tenant for r in single]  # the same popularity draws
    for tenant in {r.tenant for r in chats}:
        texts = [r.text for r in chats if r.tenant == tenant]
        for turn, text in enumerate(texts):
            if turn % 3:  # a chat's later turn: the previous one, its answer, a new question
                assert text.startswith(texts[turn - 1]) and "Answer:" in text[len(texts[turn - 1]):]
            else:
                assert "Answer:" not in text


def test_restarts_count_what_the_restarted_prefill_served_once_back_and_share_one_store_dir(tmp_path):
    from bench.routing import restarts

    def answer(ended: float, port: int, cached: int, storage: int = 0) -> dict:
        return {"ended": ended, "prefill": f"prefill-127.0.0.1-{port}", "cached_tokens": cached,
                "storage_tokens": storage, "prompt_tokens": 100, "predicted": cached, "error": None}

    answers = [answer(5.0, 27100, 90), answer(11.0, 27100, 80, 64), answer(12.0, 27101, 90),
               {"ended": 13.0, "prefill": "prefill-127.0.0.1-27100", "error": "x"}, answer(14.0, 27100, 0)]
    assert restarts.served(answers, 27100, 10.0) == {
        "requests": 2, "prompt_tokens": 200, "cached_tokens": 80, "storage_tokens": 64, "predicted": 80}
    assert restarts.served(answers, 27100, 0.0, 11.0)["requests"] == 1  # ended before 11 s
    assert restarts.served(answers, 27101, 0.0)["cached_tokens"] == 90
    args = restarts.store_args(tmp_path / "kv")
    assert args["prefill"] == ["--cluster", f"kv_store.dir={tmp_path / 'kv'}"]  # every prefill: the same directory
    assert args["decode"][:2] == args["prefill"] and "kv_store.decode_offload=false" in args["decode"]
    assert restarts.store_contents(tmp_path / "kv") == {"namespaces": 0, "pages": 0}
