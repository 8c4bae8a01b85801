"""`python -m bench.routing` (`make bench-routing`): the prefill policies side by side on real SGLang. One cluster (2
prefills, 1 decode; SmolLM2 by default), one router of ours per policy (round_robin, prefix, cache_aware) over the
same registered workers and SGLang's own router (sglang-router, its cache_aware prefill policy) over them too, and a
multi-tenant workload (bench/routing/report.py: a few tenants, each a long system prompt with Zipf popularity, short
questions) sent to each router in turn, the order rotating per repeat, every worker's cache flushed before each run.
A closed loop (--concurrency clients) or, with --rate, an open one (Poisson arrivals, as users come: a queue a policy
leaves behind grows). Each request streams from /generate (TTFT: its first event; cached tokens: its last event's
meta_info). Scored
against the oracle (the best prefill in hindsight), TTFT percentiles with their spread over repeats. Writes
bench/results/routing[-<model>][-quick].json and .png. `--dry-run`: the workload and its oracle only, nothing
started. Hold `flock /tmp/pdcluster-cluster.lock` (the Makefile target does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from bench.harness import clusters, machine, procs
from bench.harness.paths import REPO, RESULTS
from bench.routing import report
from bench.routing.load import CONCURRENCY, MAX_NEW_TOKENS, QUICK, drive, drive_open
from bench.routing.report import OURS, POLICIES, SGLANG, Shape

LEFT_OVER_PAGES = 32  # what health probes leave in a flushed cache: an index at most this is taken as empty
_PAGES = re.compile(r'^pdcluster_router_kv_index_pages\{worker="([^"]+)"\} (\S+)$', re.M)


def tokenized(model_path: str, texts: list[str]) -> list[list[int]]:
    """As SGLang encodes a /generate text: the model's tokenizer, its special tokens added."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(REPO / model_path / "tokenizer.json"))
    return [encoding.ids for encoding in tokenizer.encode_batch(texts)]


def index_pages(router: procs.Proc) -> dict[str, float]:
    return {w: float(v) for w, v in _PAGES.findall(httpx.get(f"{router.url}/metrics", timeout=10).text)}


def wait_index_flushed(router: procs.Proc, prefills: int, within: float = 30.0) -> bool:
    """Until the cache_aware router's index has heard every prefill's flush (SGLang's AllBlocksCleared)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pages = index_pages(router)
        if len(pages) == prefills and max(pages.values()) <= LEFT_OVER_PAGES:
            return True
        time.sleep(0.5)
    return False


def indexed_decisions(router: procs.Proc) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    found = re.search(r'^pdcluster_router_routing_decisions_total\{kind="indexed"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def run_all(args, log_dir: Path, log) -> tuple[list[dict], dict]:
    model = clusters.MODELS[args.model]
    cluster = clusters.start_cluster(model, 2, sleep_on_idle=True, log_dir=log_dir / "cluster")
    routers: dict[str, procs.Proc] = {}
    runs: list[dict] = []
    notes: dict = {"index_not_flushed": [], "prompt_tokens_not_as_the_oracle_counted": 0}
    try:
        cluster.wait_ready()
        settings = {"bootstrap_url": cluster.spec.bootstrap_url, "expose_worker_ids": True}
        routers = {p: procs.start_ours(f"router-{p}", log_dir, [], [], p, settings=settings) for p in OURS}
        routers[SGLANG] = procs.start_sglang(log_dir, clusters.workers(cluster, "prefill"),
                                             clusters.workers(cluster, "decode")[0], "cache_aware", SGLANG)
        for router in routers.values():
            clusters.wait_generates(router, 300)
        flush = [w.url for w in clusters.workers(cluster, "prefill") + clusters.workers(cluster, "decode")]
        page = httpx.get(f"{flush[0]}/server_info", timeout=30).json().get("page_size") or 1
        warm_up = report.workload(QUICK, seed=10_000)
        for router in routers.values():  # first forwards are slower; cache_aware's index and tokenizer get ready
            asyncio.run(drive(router.url, [r.text for r in warm_up], 2))
        notes["cache_aware_indexed_at_warm_up"] = indexed_decisions(routers["cache_aware"]) > 0
        log(f"warmed up; page size {page}; cache_aware indexed: {notes['cache_aware_indexed_at_warm_up']}")
        for repeat in range(args.repeats):
            requests = report.workload(args.shape, seed=repeat + 1)
            texts = [r.text for r in requests]
            ids = tokenized(model.path, texts)
            oracle = sum(report.oracle(ids, page))
            turn = repeat % len(POLICIES)
            for policy in (POLICIES * 2)[turn:turn + len(POLICIES)]:
                clusters.flush_caches(flush)
                if not wait_index_flushed(routers["cache_aware"], 2):
                    notes["index_not_flushed"].append(f"{policy}-{repeat}")
                began = time.monotonic()
                after = [r.after for r in requests]
                answers = asyncio.run(drive(routers[policy].url, texts, args.concurrency, after) if args.rate is None
                                      else drive_open(routers[policy].url, texts, args.rate, after, seed=repeat + 1))
                row = report.run_row(policy, repeat, answers, oracle, time.monotonic() - began)
                notes["prompt_tokens_not_as_the_oracle_counted"] += sum(  # the oracle's tokenizer is SGLang's
                    a.get("prompt_tokens") not in (None, len(i)) for a, i in zip(answers, ids, strict=True))
                runs.append(row)
                log(f"{policy} #{repeat}: cached/oracle {row['cached_over_oracle']}, TTFT p50 {row['ttft_p50_s']} s, "
                    f"by prefill {row['by_prefill']}, errors {row['errors']}")
    finally:
        for router in routers.values():
            router.stop()
        cluster.stop()
    return runs, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(clusters.MODELS), default="smollm2")
    parser.add_argument("--quick", action="store_true", help="a small workload, 1 repeat: a check of the harness")
    parser.add_argument("--repeats", type=int, help="runs of each policy (default 3, --quick 1)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--rate", type=float, help="requests a second arriving (an open loop) instead of --concurrency")
    parser.add_argument("--turns", type=int, default=1, help="turns per chat (1: single questions)")
    parser.add_argument("--prefix-tokens", type=int, help=f"a tenant's system prompt (default {Shape.prefix_tokens})")
    parser.add_argument("--question-tokens", type=int, help=f"a question or turn (default {Shape.question_tokens})")
    parser.add_argument("--open-chats", type=int, help="a tenant's chats at once, with --turns (default 1)")
    parser.add_argument("--requests", type=int, help=f"per repeat and policy (default {Shape.requests})")
    parser.add_argument("--tenants", type=int, help=f"system prompts (default {Shape.tenants})")
    parser.add_argument("--dry-run", action="store_true", help="the workload and its oracle only; nothing started")
    args = parser.parse_args(argv)
    sized = {k: v for k in ("prefix_tokens", "question_tokens", "requests", "open_chats", "tenants")
             if (v := getattr(args, k)) is not None}
    args.shape = replace(QUICK if args.quick else Shape(), turns=args.turns, **sized)
    args.repeats = args.repeats or (1 if args.quick else 3)
    model = clusters.MODELS[args.model]
    if args.dry_run:
        requests = report.workload(args.shape, seed=1)
        ids = tokenized(model.path, [r.text for r in requests])
        oracle = report.oracle(ids, 1)
        per_tenant = [sum(r.tenant == k for r in requests) for k in range(args.shape.tenants)]
        print(json.dumps({"shape": vars(args.shape), "repeats": args.repeats, "policies": POLICIES,
                          "requests_per_tenant": per_tenant, "prompt_tokens": sum(map(len, ids)),
                          "oracle_cached_tokens (page 1)": sum(oracle)}, indent=1))
        return 0
    if not (REPO / model.path / "tokenizer.json").is_file():
        parser.error(f"{model.path} is missing: `make setup` builds it")
    began, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()

    def log(line: str) -> None:
        print(f"[routing {time.monotonic() - t0:5.0f}s] {line}", flush=True)

    log_dir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    log(f"process logs in {log_dir}")
    measured_on = machine.machine()
    runs, notes = run_all(args, log_dir, log)
    summary = report.summarize(runs)
    result = {"benchmark": "prefill policies on a multi-tenant shared-prefix workload, 2 prefills + 1 decode",
              "settings": {"model": model.path, "shape": vars(args.shape), "repeats": args.repeats,
                           "concurrency": args.concurrency if args.rate is None else None, "rate": args.rate,
                           "max_new_tokens": MAX_NEW_TOKENS},
              "machine": measured_on, "started_utc": began, "wall_seconds": round(time.monotonic() - t0),
              "notes": notes, "runs": runs, "summary": summary, "verdicts": report.verdicts(summary)}
    name = ("routing" + ("" if args.model == "smollm2" else f"-{args.model}") + ("-quick" if args.quick else "")
            + (f"-chats{args.turns}" if args.turns > 1 else "")
            + (f"-p{args.shape.prefix_tokens}q{args.shape.question_tokens}"
               if {"prefix_tokens", "question_tokens"} & set(sized) else "")
            + (f"-t{args.shape.tenants}" if "tenants" in sized else "") + (f"-r{args.rate:g}" if args.rate else ""))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    report.plot(result, RESULTS / f"{name}.png")
    for line in report.lines(result):
        log(line)
    log(f"wrote bench/results/{name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
