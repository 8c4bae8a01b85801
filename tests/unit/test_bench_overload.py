"""bench/overload/'s report and load: which requests count as goodput, how refusals, 5xx and failures after admission
are told apart, the verdicts against the targets of shedding load, and the prompts and streamed chunks of the load."""

from __future__ import annotations

import json
import random

from bench.overload import load, report


def rec(sender: str = "alice", client: str = "httpx", prompt: int = 80, answer: int = 11, started: float = 1.0,
        status: int | None = 200, ttft: float | None = 0.5, itl: float = 0.1, **extra) -> dict:
    first = None if ttft is None else started + ttft
    last = None if first is None else first + itl * (answer - 1)
    row = {"sender": sender, "client": client, "prompt": prompt, "answer": answer, "started": started,
           "status": status, "first": first, "last": last, "ended": last if last is not None else started + 0.004,
           "chunks": answer if first is not None else 0, "completed": first is not None, "error": None,
           "retry_after": None, "attempts": 0}
    return {**row, **extra}


def test_goodput_counts_admitted_requests_within_the_bound_plus_their_own_prefill_and_the_itl_slo():
    bound = 3.0
    own = 80 / report.PREFILL_RATE  # 1 s for an 80-token prompt
    assert report.meets_slo(rec(ttft=bound + own), bound)
    assert not report.meets_slo(rec(ttft=bound + own + 0.01), bound)
    assert not report.meets_slo(rec(itl=report.SLO_ITL_S + 0.01), bound)
    assert not report.meets_slo(rec(error="stream error: boom"), bound)  # admitted, then failed: not good
    assert not report.meets_slo(rec(status=429, ttft=None), bound)


def test_a_phase_tells_refusals_5xx_failures_after_admission_and_the_openai_clients_fate_apart():
    records = [rec(started=1.0), rec(started=5.0, ttft=9.0),  # one good, one too late
               rec(status=429, ttft=None, retry_after="2", started=2.0),
               rec(status=429, ttft=None, retry_after="4", started=8.0),
               rec(status=503, ttft=None, error="HTTP 503: busy"),
               rec(started=3.0, error="stream ended after 3 chunks without a finish_reason"),
               rec(started=4.0, ttft=None, error="cancelled at the end of the drain"),  # unanswered, not failed
               rec(client="openai", attempts=3), rec(client="openai", status=429, ttft=None, attempts=7,
                                                      error="RateLimitError: busy")]
    s = report.summarize(records, window=9.0, bound=3.0)
    assert (s["sent"], s["admitted"], s["refused"]) == (7, 4, 2)
    assert s["goodput_per_s"] == round(1 / 9, 4) and s["goodput_slices"] == [round(1 / 3, 4), 0.0, 0.0]
    assert s["status_5xx"] == 1 and s["failed_after_admission"] == 1 and s["unanswered_at_drain_end"] == 1
    assert s["refusal_ms"] == {"p50": 4.0, "p99": 4.0} and s["retry_after_s"] == {"p50": 3.0, "max": 4.0,
                                                                                    "missing": 0}
    assert s["ttft_s"]["p50"] == 0.5 and s["ttft_s"]["n"] == 3
    assert s["openai"]["sent"] == 2 and s["openai"]["served"] == 1 and s["openai"]["attempts_max"] == 7


def phase(name: str, records: list[dict], openings: int = 0) -> dict:
    return {"name": name, "window_s": 10.0, "records": records, "router_metrics": {"breaker_openings": openings}}


def result_of(phases: list[dict]) -> dict:
    return {"settings": {"bound_s": 3.0, "phase_s": 10.0}, "capacity": {"requests_per_s": 1.0, "concurrency": 8},
            "machine": {"date_utc": "2026-12-02T15:00:00Z", "git_commit": "abcdef1234", "cpu_count": 2},
            "phases": phases}


def test_the_verdicts_judge_overload_against_1x_the_tenants_against_alices_solo_run_and_the_classes():
    good = [rec(started=float(t)) for t in range(8)]
    result = result_of([
        phase("ours 0.5x", [rec(ttft=0.4)]),
        phase("ours 1x", good),
        phase("ours 2x", [*good[:7], rec(status=429, ttft=None, ended=2.02, started=2.0, retry_after="1")]),
        phase("ours 4x", [*good[:6], rec(status=502, ttft=None)], openings=1),
        phase("ours tenants", [rec(ttft=0.5), *[rec(sender="bob", started=float(t)) for t in range(5)]]),
        phase("ours classes", [rec(sender="interactive", ttft=0.4), rec(sender="batch", ttft=1.0)]),
    ])
    verdicts = report.derive(result)["verdicts"]
    assert verdicts["ours 2x: goodput / 1x's"] == {"value": 0.875, "target": ">= 0.9", "pass": False}
    assert verdicts["ours 2x: refusal p99 ms"]["pass"] and verdicts["ours 2x: refusal p99 ms"]["value"] == 20.0
    assert verdicts["ours 4x: refusal p99 ms"]["pass"]  # none refused: nothing was late
    assert not verdicts["ours 4x: 5xx"]["pass"] and not verdicts["ours 4x: breaker openings"]["pass"]
    assert verdicts["tenants: alice's TTFT p99 / her solo run's"]["value"] == 1.25
    assert verdicts["tenants: bob (10x his share) admitted / his share"] == {"value": 1.0, "target": ">= 0.8",
                                                                            "pass": True}
    assert verdicts["classes at 2x: interactive TTFT p50 / batch's"] == {"value": 0.4, "target": "<= 0.5",
                                                                        "pass": True}


def test_the_table_shows_each_phase_and_each_sender_of_a_shared_phase():
    result = result_of([phase("ours 1x", [rec()]), phase("ours tenants", [rec(), rec(sender="bob", status=429,
                                                                                     ttft=None)])])
    result["derived"] = report.derive(result)
    text = report.table(result)
    assert "| ours 1x | 0.10 | 0.10 | 0.100 (0.000-0.300) | 0.50/0.50 | -/- | - | 0 | 0 (+0) | 0 | 0/0, - |" in text
    assert "| ours tenants: bob | 0.10 | 0.00 |" in text and "capacity 1.000 requests/s" in text
    assert report._readme_row("ours tenants: bob", result["derived"]["phases"]["ours tenants"]["bob"], {}) == [
        "ours tenants: bob", "0.10/0.00/0.000", "-/-", "4/4", "0/0/0/-", "0/0 (-)"]
    assert report.readme_verdicts(result) == "Targets met: 0 of 0. **Not met**: none."


def test_prompts_are_whole_words_of_the_vocabulary_and_a_stream_is_read_chunk_by_chunk(tmp_path):
    vocab = {"\u0120apple": 1, "\u0120Pear": 2, "\u0120fig": 3, "plum": 4, "\u0120cherry": 5, "\u0120a1b": 6}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    words = load.words(tmp_path)
    assert words == ["apple", "cherry", "fig"]
    body = load.body("m", 5, 7, random.Random(1), words)
    assert len(body["prompt"].split()) == 5 and body["max_tokens"] == 7 and body["ignore_eos"] is True
    r = load.Record("alice", "httpx", 5, 2, 0.0)
    assert load._chunk(r, 'data: {"choices": [{"text": "x", "finish_reason": null}]}')
    assert load._chunk(r, 'data: {"choices": [{"text": "y", "finish_reason": "length"}]}')
    assert not load._chunk(r, "data: [DONE]")
    assert r.chunks == 2 and r.completed and r.first is not None and r.error is None
    assert not load._chunk(r, 'data: {"error": {"message": "decode failed"}}') and "decode failed" in r.error
