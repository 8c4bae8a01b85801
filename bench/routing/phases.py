"""`python -m bench.routing.phases [result.json]`: where a bench.routing run's TTFT went, per policy and repeat, from
its answers (their prefill, TTFT, seconds, computed tokens and when each was sent). Nothing is started.

A request is in its prefill phase from its sending to its first token (queued on its prefill, computed, handed to
the decode, taken in by it) and in its decode phase from then to its end. Per policy: TTFT p50 by prefill and
without the cold start (the requests sent at once at the start, none cached); how long each prefill, both at once and
the decode had a request in that phase; requests in flight on average; and the prompt tokens a request computed per
second of its TTFT when nothing else was in flight, when others were but none in its prefill's phase on its prefill
(what the others' work costs it on a machine whose prefills and decode share cores), and when one was (queued or
batched with it). A result written before answers kept their sending time
(`sent_s`) is replayed: bench.routing's closed loop again, each request taking the seconds it took (its workload
made anew from the settings; the replayed run's length is printed beside the measured one, a check).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from bench.harness.paths import RESULTS
from bench.routing.report import Shape, workload

RESULT = RESULTS / "routing.json"
ALONE = 0.1  # a request ran alone when others were in flight for at most this share of its TTFT


def replay(answers: list[dict], after: list[int | None], concurrency: int) -> list[float]:
    """When each request was sent, had bench.routing.drive's clients taken the seconds each request took."""
    sent: list[float] = [0.0] * len(answers)
    ended: list[float] = [0.0] * len(answers)
    free = [0.0] * concurrency  # when each client takes its next request
    for i, answer in enumerate(answers):
        client = min(range(concurrency), key=free.__getitem__)
        before = after[i]
        sent[i] = max(free[client], ended[before]) if before is not None else free[client]
        ended[i] = free[client] = sent[i] + answer.get("seconds", 0.0)
    return sent


def spans(run: dict, settings: dict) -> list[dict]:
    """The run's answered requests, each with its prefill phase (sent, first) and decode phase (first, end)."""
    answers = run["answers"]
    if all("sent_s" in a for a in answers if a.get("error") is None):
        sent = [a.get("sent_s", 0.0) for a in answers]  # an error's is not read
    else:
        requests = workload(Shape(**settings["shape"]), seed=run["repeat"] + 1)  # bench.routing's seed
        sent = replay(answers, [r.after for r in requests], settings["concurrency"])
    return [{"prefill": a.get("prefill") or "?", "sent": s, "first": s + a["ttft_s"], "end": s + a["seconds"],
             "ttft": a["ttft_s"], "computed": (a.get("prompt_tokens") or 0) - a["cached_tokens"]}
            for a, s in zip(answers, sent, strict=True) if a.get("error") is None]


def _seconds(spans_: list[dict], when) -> float:
    """How long `when(t)` held over the run, t between the spans' edges."""
    edges = sorted({e for s in spans_ for e in (s["sent"], s["first"], s["end"])})
    return sum(b - a for a, b in itertools.pairwise(edges) if when((a + b) / 2))


def phases(run: dict, settings: dict) -> dict:
    rows = spans(run, settings)
    prefills = sorted({r["prefill"] for r in rows})

    def in_prefill(t: float, prefill: str | None = None) -> bool:
        return any(r["sent"] <= t < r["first"] and prefill in (None, r["prefill"]) for r in rows)

    def decoding(t: float) -> bool:
        return any(r["first"] <= t < r["end"] for r in rows)

    def beside(r: dict, same: bool) -> float:  # seconds of its TTFT with another request in flight (same: queued
        return _seconds([r, *rows], lambda t: r["sent"] <= t < r["first"] and any(  # or batched on its prefill)
            o is not r and (o["sent"] <= t < o["first"] and o["prefill"] == r["prefill"] if same
                            else o["sent"] <= t < o["end"]) for o in rows))

    alone = [r for r in rows if beside(r, False) <= ALONE * r["ttft"]]
    sharing = [r for r in rows if r not in alone and beside(r, True) > ALONE * r["ttft"]]
    crowded = [r for r in rows if r not in alone and r not in sharing]
    start = min(r["sent"] for r in rows)
    warm = [r["ttft"] for r in rows if r["sent"] > start]
    return {"policy": run["policy"], "repeat": run["repeat"], "seconds": run["seconds"],
            "replayed_seconds": round(max(r["end"] for r in rows) - start, 1),
            "ttft_p50_s": statistics.median(r["ttft"] for r in rows),
            "ttft_p50_after_cold_start_s": statistics.median(warm) if warm else None,
            "by_prefill": {p: {"requests": sum(r["prefill"] == p for r in rows),
                               "computed_tokens": sum(r["computed"] for r in rows if r["prefill"] == p),
                               "ttft_p50_s": statistics.median(r["ttft"] for r in rows if r["prefill"] == p),
                               "busy_s": round(_seconds(rows, lambda t, p=p: in_prefill(t, p)), 1)}
                           for p in prefills},
            "both_prefills_busy_s": round(_seconds(rows, lambda t: all(in_prefill(t, p) for p in prefills)), 1),
            "decode_busy_s": round(_seconds(rows, decoding), 1),
            "in_flight": round(sum(r["end"] - r["sent"] for r in rows) / (max(r["end"] for r in rows) - start), 2),
            "tokens_per_ttft_s": {"alone": _rate(alone), "beside_others": _rate(crowded),
                                  "sharing_its_prefill": _rate(sharing)}}


def _rate(rows: list[dict]) -> dict:
    return {"requests": len(rows),
            "tokens_per_s": round(sum(r["computed"] for r in rows) / sum(r["ttft"] for r in rows), 1) if rows else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing.phases", description=__doc__.splitlines()[0])
    parser.add_argument("result", nargs="?", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    for run in result["runs"]:
        if any(a.get("error") is None for a in run["answers"]):
            print(json.dumps(phases(run, result["settings"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
