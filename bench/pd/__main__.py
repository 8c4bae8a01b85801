"""`python -m bench.pd` (`make bench-pd`): the regime PD exists for, on this machine's 2 cores.

K=4 closed-loop clients stream long answers (96 tokens) from short prompts while long prompts (~2000 tokens, 4 new
tokens) arrive at a steady rate, swept over that rate. Two modes on the same cores, both running for the whole run:
  colocated  one plain SGLang server given both cores (bench.harness.clusters.start_colocated: the CPU profile,
             sleep-on-idle, chunked prefill as SGLang sets it);
  pd         1 prefill pinned to core 0 + 1 decode pinned to core 1 (`cluster.cpus`) through our router
             (pdcluster.local, configs/prefill.yaml + decode.yaml, bootstrap service and router); the prefill
             schedules as PREFILL_SCHEDULING says (`--prefill-args ""`: SGLang's defaults, as the colocated server).
Each cell (mode x rate) runs twice, modes alternating (A B ... then B A ...). Per cell: the streams' ITL, TTFT of
short and long prompts, output tokens/s, streams completed with their own ITL p99, each process tree's CPU, and the
SGLang metrics' per-stage latencies (where a request's time goes). bench/pd/report.py derives goodput, the ratios
and the verdicts and draws the picture. Writes bench/results/pd.json and pd.png. Hold
`flock /tmp/pdcluster-cluster.lock` (the Makefile target does). `--dry-run`: the harness against
bench/harness/fake_worker.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import clusters, cpu, machine, procs
from bench.harness.cpu import Tree, settle
from bench.harness.paths import REPO, RESULTS
from bench.pd import load, report

# A prefill worker with one core and a mix of long and short prompts: SGLang's defaults (fcfs, one 4096-token chunk)
# make a short prompt wait for every long prompt queued before it, each a forward of seconds; shortest-prefill-first
# lets it pass them, and 256-token chunks bound what it waits for to one chunk's forward (~1 s on one core). The
# CPU attention plugin makes the extra chunks cheap (each computes only its own queries). bench/README: PD benchmark.
PREFILL_SCHEDULING = "--chunked-prefill-size 256 --schedule-policy shortest-prefill-first"
METRICS = ("sglang:per_stage_req_latency_seconds", "sglang:queue_time_seconds", "sglang:kv_transfer_latency_ms",
           "sglang:kv_transfer_bootstrap_ms", "pdcluster_router_ttft_seconds", "sglang:time_to_first_token_seconds",
           "sglang:inter_token_latency_seconds")


def scrape(url: str) -> dict[str, float]:
    """The histograms' _sum/_count and the gauges of METRICS, summed over label sets but the stage's."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in METRICS:
                continue
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")) or family.type == "gauge":
                    key = s.name + (f"[{s.labels['stage']}]" if "stage" in s.labels else "")
                    out[key] = out.get(key, 0.0) + s.value
    except ValueError:
        return {}
    return out


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, dict]:
    """Per histogram (and stage) over the cell: how many observations, their mean in ms; gauges as they end."""
    out = {}
    for key, value in after.items():
        if key.endswith("_count") or "_count[" in key:
            count = value - before.get(key, 0.0)
            total_key = key.replace("_count", "_sum")
            total = after.get(total_key, 0.0) - before.get(total_key, 0.0)
            if count > 0:
                scale = 1.0 if "_ms" in key else 1000.0
                out[key.replace("_count", "")] = {"n": int(count), "mean_ms": round(scale * total / count, 1)}
        elif not key.endswith("_sum") and "_sum[" not in key:
            out[key] = {"last": round(value, 3)}
    return out


def start(args, model: clusters.BenchModel, log_dir: Path) -> tuple[dict, list]:
    """Both modes, started at once; returns {mode: (url, worker urls)} and what to stop."""
    if args.dry_run:
        (fake,) = procs.start_fakes(log_dir, args.shape.stream_tokens, names=("fake",))
        return {m: (fake.url, [], {"fake": Tree(fake.popen.pid)}) for m in ("colocated", "pd")}, [fake]
    metrics = ["--enable-metrics"]
    colocated = clusters.start_colocated(model, log_dir, sleep_on_idle=True,
                                        extra_args=[*metrics, *shlex.split(args.colocated_args)])
    stop: list = [colocated]
    try:
        cluster = clusters.start_cluster(model, 1, sleep_on_idle=True, log_dir=log_dir / "pd", extra_args={
            "prefill": ["--cluster", f"cpus={args.cores[0]}", *metrics, *shlex.split(args.prefill_args)],
            "decode": ["--cluster", f"cpus={args.cores[1]}", *metrics]})
        stop.append(cluster)
        cluster.wait_ready()
        clusters.wait_generates(colocated)
    except BaseException:
        for thing in stop:
            thing.stop()
        raise
    workers = [w.url for role in ("prefill", "decode") for w in clusters.workers(cluster, role)]
    pd_trees = {name: Tree(p.popen.pid) for name, p in cluster.processes.items()}
    return {"colocated": (colocated.url, [colocated.url], {"colocated": Tree(colocated.popen.pid)}),
            "pd": (cluster.router_url, [*workers, cluster.router_url], pd_trees)}, stop


def cell(args, mode: str, target: tuple, period: float | None, repeat: int, all_trees: dict, log) -> dict:
    url, scraped, trees = target
    if not args.dry_run:
        clusters.flush_caches([u for u in scraped if u != url or mode == "colocated"])
    probe = cpu.probe_ms()
    before = {u: scrape(u) for u in scraped}
    window = cpu.Window({name: t.pid for name, t in all_trees.items()})
    records, t0, t1 = asyncio.run(load.run_cell(url, args.shape, period, args.warmup, args.duration, args.drain,
                                                   seed=1000 * repeat + int(period or 0)))
    cores = window.cores()
    stages = {u: stage_means(before[u], scrape(u)) for u in scraped}
    settled = settle(trees, max_wait=30)
    row = {"mode": mode, "period_s": period, "repeat": repeat, **load.summarize(records, t0, t1),
           "cpu_cores": cores["per_tree"], "cores_used_by_others": cores["others"], "machine_probe_ms": probe,
           "metrics": stages, "settle_s": settled}
    log(f"{mode} every {period or '-'} s, repeat {repeat}: ITL p50/p99/max {row['itl_ms']['p50']}/"
        f"{row['itl_ms']['p99']}/{row['itl_ms']['max']} ms, TTFT short p50 {row['ttft_short_ms']['p50']} ms, long "
        f"p50 {row['ttft_long_ms']['p50']} ms ({row['long_sent']} sent, {row['long_unanswered']} unanswered), "
        f"{row['output_tokens_per_s']} tok/s, {row['streams_completed']} streams, errors {row['errors']}")
    return row


def run_model(args, name: str, log) -> dict:
    model = clusters.MODELS[name]
    vocab = json.loads((REPO / model.path / "config.json").read_text())["vocab_size"] if not args.dry_run else 1000
    args.shape = load.Shape(long_len=args.long_len, vocab=vocab)
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-pd-{name}-"))
    log(f"{name}: logs in {log_dir}")
    began = time.monotonic()
    modes, stop = start(args, model, log_dir)
    startup_s = round(time.monotonic() - began, 1)
    all_trees = {k: v for _, _, trees in modes.values() for k, v in trees.items()}
    cells = []
    try:
        server_info = {} if args.dry_run else httpx.get(f"{modes['colocated'][0]}/server_info", timeout=10).json()
        for target in modes.values():  # unrecorded: the first load on a server is slower
            asyncio.run(load.run_cell(target[0], args.shape, 2 * args.warmup, args.warmup, 0.0, args.drain, seed=7))
        for repeat in range(args.repeats):
            order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
            for period in args.periods:
                for mode in order:
                    cells.append(cell(args, mode, modes[mode], period, repeat, all_trees, log))
    finally:
        for thing in stop:
            thing.stop()
    return {"model": model.path, "startup_s": startup_s, "log_dir": str(log_dir), "cells": cells,
            "colocated_chunked_prefill_size": server_info.get("chunked_prefill_size"),
            "colocated_schedule_policy": server_info.get("schedule_policy")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=sorted(clusters.MODELS))
    parser.add_argument("--periods", nargs="+", type=float, default=[0, 12, 6],
                        help="seconds between long prompts; 0: none")
    parser.add_argument("--duration", type=float, default=50.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--drain", type=float, default=45.0, help="seconds in-flight requests get after a cell")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--long-len", type=int, default=2000)
    parser.add_argument("--cores", nargs=2, type=int, default=[0, 1], help="the prefill's and the decode's core")
    parser.add_argument("--prefill-args", default=PREFILL_SCHEDULING,
                        help=f"SGLang options for PD's prefill (default: {PREFILL_SCHEDULING!r}; '': SGLang's own)")
    parser.add_argument("--colocated-args", default="", help="SGLang options for the colocated server")
    parser.add_argument("--quick", action="store_true", help="a ~5 minute check of the harness")
    parser.add_argument("--dry-run", action="store_true", help="against bench/harness/fake_worker.py, no SGLang")
    parser.add_argument("--out", default=None, help="results path without extension")
    args = parser.parse_args(argv)
    if args.quick:
        args.periods, args.duration, args.warmup, args.drain, args.repeats = [0, 6], 20.0, 6.0, 30.0, 1
    if args.dry_run:
        args.duration, args.warmup, args.drain = min(args.duration, 3.0), 1.0, 5.0
    args.periods = [p or None for p in args.periods]
    out = Path(args.out) if args.out else RESULTS / ("pd-dry-run" if args.dry_run else "pd-quick" if args.quick
                                                     else "pd")
    began, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()
    measured_on = {**machine.machine(), "cores_busy_before_start": round(cpu.busy_cores(2.0), 3)}

    def log(line: str) -> None:
        print(f"bench.pd [{time.monotonic() - t0:6.0f} s] {line}", flush=True)

    runs = {name: run_model(args, name, log) for name in args.models}
    result = {"started_utc": began, "wall_seconds": round(time.monotonic() - t0), "machine": measured_on,
              "settings": {"periods_s": args.periods, "duration_s": args.duration, "warmup_s": args.warmup,
                           "drain_s": args.drain, "repeats": args.repeats, "cores": args.cores,
                           "prefill_args": args.prefill_args, "colocated_args": args.colocated_args,
                           "shape": vars(args.shape), "dry_run": args.dry_run},
              "models": {name: {**run, "derived": report.derive(run["cells"])} for name, run in runs.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    report.draw(result, Path(f"{out}.png"))
    print(report.table(result))
    log(f"wrote {out}.json and .png")


if __name__ == "__main__":
    main()
