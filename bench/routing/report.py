"""bench.routing's pure parts: the multi-tenant workload, the oracle it is scored against, the summary over repeats,
the verdicts and the picture. Nothing here starts a process (tests/unit/test_bench_routing.py runs all of it).

The workload: `tenants` system prompts of ~`prefix_tokens` words each (words of a short vocabulary are about a token
each), picked per request with Zipf popularity (tenant k with weight 1 / (k + 1)^zipf), each followed by a question of
~`question_tokens` fresh words; with `turns` > 1, a tenant's requests are the turns of its chats (each the chat so far,
questions and written answers, then a new question). A seed makes it anew: no repeat profits from another's prompts.

The oracle is the best prefill in hindsight with caches that never evict: a request's cached tokens are the longest
prefix it shares with any earlier request, as SGLang reuses it (whole pages, of all but the prompt's last token).
No router can beat it; a policy's cached tokens over the oracle's say how much of the reusable KV it found.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.markdown import grid, load, met, num, source, spread
from bench.harness.paths import RESULTS

WORDS = ("river", "stone", "light", "market", "window", "garden", "paper", "silver", "cloud", "engine", "forest",
         "signal", "bridge", "copper", "harbor", "winter")
OURS = ("round_robin", "prefix", "cache_aware")  # pdcluster's router, one per policy
SGLANG = "sglang_cache_aware"  # SGLang's own router (sglang-router), its cache-aware prefill policy, same workers
POLICIES = (*OURS, SGLANG)
CACHED_OVER_ORACLE = 0.95  # the targets (the issue's): cached tokens of cache_aware at least this share of the oracle's
TTFT_OVER_ROUND_ROBIN = 0.6  # ... and its TTFT p50 at most this share of round robin's, in the same repeat


@dataclass(frozen=True)
class Shape:
    tenants: int = 4
    prefix_tokens: int = 700
    question_tokens: int = 40
    requests: int = 48
    zipf: float = 1.0
    turns: int = 1  # > 1: a tenant's requests are the turns of its chats, each carrying the chat so far
    open_chats: int = 1  # a tenant's chats going on at once (turns > 1), its requests spread over them at random


@dataclass(frozen=True)
class Request:
    tenant: int
    text: str
    after: int | None = None  # the request whose answer this turn follows: sent only once that one is answered


def workload(shape: Shape, seed: int) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [f"You are the assistant of tenant {k} (run {seed}). Their handbook: "
                + " ".join(rng.choice(WORDS) for _ in range(shape.prefix_tokens)) + "\n" for k in range(shape.tenants)]
    weights = [1 / (k + 1) ** shape.zipf for k in range(shape.tenants)]
    requests = []
    answers = random.Random(-seed)  # apart: the tenants and questions drawn are single questions' with `turns` 1
    chats_rng = random.Random(seed + 7919)  # apart too: one open chat draws what earlier results drew
    # per (tenant, chat): the chat so far, the turns it has had, its last request
    chats: dict[tuple[int, int], tuple[str, int, int | None]] = {}
    for i in range(shape.requests):
        tenant = rng.choices(range(shape.tenants), weights)[0]
        question = " ".join(rng.choice(WORDS) for _ in range(shape.question_tokens))
        chat = (tenant, chats_rng.randrange(shape.open_chats) if shape.open_chats > 1 else 0)
        history, turns, last = chats.get(chat, ("", 0, None))
        if turns >= shape.turns:
            history, turns, last = "", 0, None  # that chat is over: a new one
        requests.append(Request(tenant, f"{prefixes[tenant]}{history}Question {i}: {question}?", last))
        if shape.turns > 1:  # the answer, as the next turn carries it (written here: the model's is not known yet)
            answer = " ".join(answers.choice(WORDS) for _ in range(shape.question_tokens))
            chats[chat] = (f"{history}Question {i}: {question}? Answer: {answer}.\n", turns + 1, i)
    return requests


def reusable(shared: int, prompt: int, page: int) -> int:
    """What SGLang reuses of `shared` leading tokens held: whole pages, of all but the prompt's last token."""
    return min(shared, prompt - 1) // page * page


def oracle(prompts: Sequence[Sequence[int]], page: int) -> list[int]:
    """Per prompt (in order), the cached tokens of the best prefill in hindsight, with caches that never evict."""
    cached = []
    for i, ids in enumerate(prompts):
        shared = 0
        for earlier in prompts[:i]:
            n = 0
            for a, b in zip(ids, earlier, strict=False):
                if a != b:
                    break
                n += 1
            shared = max(shared, n)
        cached.append(reusable(shared, len(ids), page) if ids else 0)
    return cached


def percentile(values: Sequence[float], q: float) -> float | None:
    """Interpolated between the nearest ranks (q = 0.5: the median)."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_row(policy: str, repeat: int, answers: list[dict], oracle_cached: int, seconds: float) -> dict:
    """One policy's run of one repeat's workload: `answers` are bench.routing.load.one()'s, in the workload's order."""
    ok = [a for a in answers if a.get("error") is None]
    ttfts = [a["ttft_s"] for a in ok]
    cached = sum(a["cached_tokens"] for a in ok)
    by_prefill: dict[str, int] = {}
    for a in ok:
        by_prefill[a.get("prefill") or "?"] = by_prefill.get(a.get("prefill") or "?", 0) + 1
    predicted = [a["predicted"] for a in ok if a.get("predicted") is not None]
    computed = sum(a.get("prompt_tokens") or 0 for a in ok) - cached  # what the prefills computed: their events' rate
    return {"policy": policy, "repeat": repeat, "requests": len(answers), "errors": len(answers) - len(ok),
            "seconds": round(seconds, 2), "cached_tokens": cached, "oracle_cached_tokens": oracle_cached,
            "computed_tokens_per_s": round(computed / seconds, 1) if seconds > 0 else None,
            "cached_over_oracle": round(cached / oracle_cached, 4) if oracle_cached else None,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
            "by_prefill": by_prefill, "predicted_cached_tokens": sum(predicted) if predicted else None,
            "answers": [{k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()} for a in answers]}


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarize(runs: list[dict]) -> dict:
    """Per policy: cached over oracle and TTFT p50, median and range over repeats; per repeat, each policy's TTFT p50
    over round robin's in that repeat (paired: a drift of the machine between repeats moves both)."""
    summary: dict = {"policies": {}, "ttft_p50_over_round_robin": {}}
    for policy in POLICIES:
        rows = [r for r in runs if r["policy"] == policy]
        cell = {}
        for key in ("cached_over_oracle", "ttft_p50_s", "ttft_p90_s"):
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                cell[key] = _median_range(values)
        cell["errors"] = sum(r["errors"] for r in rows)
        summary["policies"][policy] = cell
        paired = [r["ttft_p50_s"] / base["ttft_p50_s"] for r in rows for base in runs
                  if base["policy"] == "round_robin" and base["repeat"] == r["repeat"]
                  and r.get("ttft_p50_s") is not None and base.get("ttft_p50_s")]
        if paired and policy != "round_robin":
            summary["ttft_p50_over_round_robin"][policy] = {**_median_range(paired),
                                                            "every_repeat_below_1": all(p < 1 for p in paired)}
    ours = [r["ttft_p50_s"] / peer["ttft_p50_s"] for r in runs for peer in runs
            if r["policy"] == "cache_aware" and peer["policy"] == SGLANG and peer["repeat"] == r["repeat"]
            and r.get("ttft_p50_s") is not None and peer.get("ttft_p50_s")]
    if ours:
        below = all(p < 1 for p in ours)
        summary["ttft_p50_cache_aware_over_sglang"] = {**_median_range(ours), "every_repeat_below_1": below}
    return summary


def verdicts(summary: dict) -> dict:
    ours = summary["policies"].get("cache_aware", {})
    cached = ours.get("cached_over_oracle", {}).get("median")
    ttft = summary["ttft_p50_over_round_robin"].get("cache_aware", {}).get("median")
    peer = summary.get("ttft_p50_cache_aware_over_sglang", {}).get("median")
    return {"ttft_p50_over_sglangs_cache_aware": {"value": peer, "target": "< 1", "met": peer is not None and peer < 1},
            "cached_over_oracle": {"value": cached, "target": f">= {CACHED_OVER_ORACLE}",
                                   "met": cached is not None and cached >= CACHED_OVER_ORACLE},
            "ttft_p50_over_round_robin": {"value": ttft, "target": f"<= {TTFT_OVER_ROUND_ROBIN}",
                                          "met": ttft is not None and ttft <= TTFT_OVER_ROUND_ROBIN},
            "no_errors": {"value": sum(c.get("errors", 0) for c in summary["policies"].values()), "target": "0",
                          "met": all(c.get("errors", 0) == 0 for c in summary["policies"].values())}}


def lines(result: dict) -> list[str]:
    out = []
    for policy, cell in result["summary"]["policies"].items():
        cached, ttft = cell.get("cached_over_oracle"), cell.get("ttft_p50_s")
        out.append(f"{policy}: cached/oracle {spread(cached)}, TTFT p50 {spread(ttft, unit='s')}, "
                   f"errors {cell['errors']}")
    for name, verdict in result["verdicts"].items():
        out.append(f"{name}: {verdict['value']} (target {verdict['target']}): {'met' if verdict['met'] else 'NOT met'}")
    return out


def plot(result: dict, path: Path) -> None:
    from bench.harness.plot import pyplot, save, stamp

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for x, policy in enumerate(POLICIES):
        rows = [r for r in result["runs"] if r["policy"] == policy]
        left.plot([x] * len(rows), [r["cached_over_oracle"] or 0 for r in rows], "o", alpha=0.7)
        right.plot([x] * len(rows), [r["ttft_p50_s"] or 0 for r in rows], "o", alpha=0.7)
    left.axhline(CACHED_OVER_ORACLE, color="red", linestyle="--", label=f"target {CACHED_OVER_ORACLE}")
    left.set(ylabel="cached prompt tokens / oracle's", title="cached tokens (each dot a repeat)", ylim=(0, 1.05))
    left.legend()
    rr = result["summary"]["policies"].get("round_robin", {}).get("ttft_p50_s")
    if rr:
        right.axhline(TTFT_OVER_ROUND_ROBIN * rr["median"], color="red", linestyle="--",
                      label=f"target: {TTFT_OVER_ROUND_ROBIN}x round robin")
        right.legend()
    right.set(ylabel="TTFT p50 (s)", title="time to first token")
    for axis in (left, right):
        axis.set_xticks(range(len(POLICIES)), POLICIES)
    shape = result["settings"]["shape"]
    fig.suptitle(f"prefill policies, 2 prefills, {shape['tenants']} tenants x ~{shape['prefix_tokens']}-token prefix "
                 f"({stamp(result['machine'])})")
    save(fig, path)


def readme_table(name: str = "routing.json") -> str:
    """bench/README.md's table of a run: each policy against the oracle and round robin; cache_aware's verdicts."""
    result = load(name)
    summary = result["summary"]
    rows = [[policy, spread(cell.get("cached_over_oracle")), spread(cell.get("ttft_p50_s")),
             spread(summary["ttft_p50_over_round_robin"].get(policy)), str(cell["errors"])]
            for policy, cell in summary["policies"].items()]
    verdicts = "; ".join(f"{name.replace('_', ' ')} {v['value'] if isinstance(v['value'], int) else num(v['value'], 3)}"
                         f" ({v['target']}): {met(v['met'])}" for name, v in result["verdicts"].items())
    settings = result["settings"]
    shape, rate = settings["shape"], settings.get("rate")
    load_ = f"arriving at {rate:g}/s (open loop)" if rate else f"{settings['concurrency']} in flight (closed loop)"
    return (source(result, name) + f" medians (min-max) of {settings['repeats']} repeats, "
            f"{shape['requests']} requests each, {load_}, {shape['tenants']} tenants\n\n"
            + grid(["policy", "cached / oracle", "TTFT p50 s", "TTFT p50 / round robin's", "errors"], rows)
            + f"\n\ncache_aware's targets: {verdicts}.")


def readme_decision(name: str = "routing-decision.json") -> str:
    """bench/README.md's line on bench.routing.decision's run."""
    result = load(name)
    # The worst cell per prompt length (routes and shared or novel prompts alike): the target is on the worst.
    sizes = sorted({round(d["tokens"], -3) for d in result["decisions"]})
    worst = {n: max((d for d in result["decisions"] if round(d["tokens"], -3) == n), key=lambda d: d["p99_ms"])
             for n in sizes}
    cells = ", ".join(f"{n} tokens {d['p50_ms']:.2f} / {d['p99_ms']:.2f}" for n, d in worst.items())
    events, verdict = result["events"], result["verdict"]
    credit = max(d.get("credit_p50_ms", 0) for d in result["decisions"])
    return (source(result, name) + f" p50 / p99 ms of the worst route and prompt: {cells}; then the credit: "
            f"{credit:.1f} ms. Events: "
            f"{events['cpu_us_per_token']:.1f} µs of CPU a stored token, {100 * events['core_share']:.2f}% of a core "
            f"at {events['tokens_per_s']:.0f} tokens/s ({events['rate_from']}). Targets: {met(verdict['met'])}.")


def readme_restarts(name: str = "routing-restarts.json") -> str:
    """bench/README.md's table of a bench.routing.restarts run."""
    if not (RESULTS / name).is_file():  # a variant not run yet (the others' results are all committed)
        return "Not run yet."
    result = load(name)
    rows = [[p["phase"], str(p["requests"]), str(p["errors"]), num(p["hit_ratio"], 3), num(p["blind_share"], 3),
             num(p["seconds_to_recover"], 1)] for p in result["phases"]]
    once_back = ("\n\nRestarted prefill, once back: {requests} requests, {cached_tokens} / {prompt_tokens} prompt "
                 "tokens cached ({storage_tokens} from the store), {predicted} predicted.".format(**back)
                 if (back := result.get("restarted_prefill", {}).get("once_back")) else "")
    return (source(result, name) + f" steady (its second half) hit ratio {result['steady_hit_ratio']:.3f}\n\n"
            + grid(["phase", "requests", "errors", "hit ratio", "blind share", "s until back"], rows) + once_back)
