"""`python -m bench.tracing.cost`: the router's CPU per request with tracing off and on, on FAKE workers.

Three routers (`python -m router`, one process each) over the same two fake SGLang workers
(bench/harness/fake_worker.py): tracing off; on, every request traced; on, 1% of requests sampled (OTEL_TRACES_SAMPLER).
A traced router's exporter process (router/tracing/export.py) exports over real OTLP/HTTP (the SDK's batch processor and
OTLP exporter at their defaults, as in production) to a receiver in this process (bench/harness/otlp_receiver.py) that
parses every batch and counts its spans, at nice 19: a collector runs elsewhere, not on the 2 cores the router is
measured on. Each round drives each router with wrk (the router benchmark's cells, bench/harness/loadgen.py), plain and
streamed, in turn, which goes first rotating. The cost, in CPU seconds (every thread) over the requests answered, not
wall time, is counted apart for the router process (the target's verdict: a request waits on it alone) and for its
children (the exporter process, and multiprocessing's idle resource tracker), and summed (the whole cost). It writes
bench/results/tracing-cost.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.harness import loadgen, procs
from bench.harness.otlp_receiver import Receiver
from bench.harness.paths import RESULTS
from bench.harness.plot import pyplot, save, stamp
from bench.harness.stats import percentile, spread

TARGET = 1.05  # tracing on may cost the router at most 5% more CPU per request
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
VARIANTS: dict[str, dict[str, str]] = {"off": {}, "on": {}, "sampled": SAMPLED}  # name: its own OTEL_* variables
TRACED = ("on", "sampled")
SPANS_PER_REQUEST = 4  # server, attempt, prefill, decode
LABELS = {"off": "off", "on": "on", "sampled": "on, 1% sampled"}
PARTS = ("router", "exporter", "sum")  # the router process, its children (the exporter), both


@dataclass
class Part:
    """What `measure` counts the CPU of (its `cpu_seconds`): a router process alone, or its children alone."""
    proc: procs.Proc
    children: bool

    def cpu_seconds(self) -> float:
        found = procs.tree(self.proc.popen.pid)
        total = 0.0
        for p in found[1:] if self.children else found[:1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total


def add_parts(cell: dict, variant: str) -> dict:
    """The cell's CPU ms per request of the router process (measure's target), of its children, and their sum."""
    cores, router = cell["cpu_cores"], cell["target_cpu_ms_per_request"]
    ratio = cores.get(f"exporter_{variant}", 0.0) / cores[f"router_{variant}"] if cores[f"router_{variant}"] else 0.0
    exporter = round(router * ratio, 4) if router is not None else None
    return {**cell, "exporter_cpu_ms_per_request": exporter,
            "sum_cpu_ms_per_request": round(router + exporter, 4) if router is not None else None}


def ms(cell: dict, part: str) -> float:
    return cell["target_cpu_ms_per_request" if part == "router" else f"{part}_cpu_ms_per_request"]


def derive(cells: list[dict], modes: list[str]) -> dict:
    """Per mode and part (PARTS): each variant's CPU ms per request over the rounds, and on / off per round (paired
    within a round, so that a machine slower in one round weighs on both), as percentiles over the rounds and pooled.
    The router process's keys are named as before the exporter process: cpu_ms_per_request_<v>, ratio_<v>_over_off."""
    out: dict = {}
    for mode in modes:
        rounds = sorted({c["round"] for c in cells if c["mode"] == mode})
        cpu = {v: [next(c for c in cells if (c["mode"], c["round"], c["target"]) == (mode, r, v))
                   for r in rounds] for v in VARIANTS}
        out[mode] = {}
        for part in PARTS:
            tail = "" if part == "router" else f"_{part}"
            per_request = {v: [ms(c, part) for c in cpu[v]] for v in VARIANTS}
            pooled = {v: sum(ms(c, part) * c["requests"] for c in cpu[v]) / sum(c["requests"] for c in cpu[v])
                      for v in VARIANTS}
            out[mode].update({f"cpu_ms_per_request_{v}{tail}": spread(per_request[v]) for v in VARIANTS})
            if part == "exporter":  # off has no exporter: no ratio
                continue
            for v in TRACED:
                ratios = [on / off for off, on in zip(per_request["off"], per_request[v], strict=True)]
                out[mode][f"ratio_{v}{tail}_over_off"] = spread(ratios)
                out[mode][f"ratio_{v}{tail}_per_round"] = [round(r, 4) for r in ratios]
                out[mode][f"ratio_{v}{tail}_pooled"] = round(pooled[v] / pooled["off"], 4)
        out[mode]["req_per_s_p50"] = {v: round(percentile([c["req_per_s"] for c in cpu[v]], 50)) for v in VARIANTS}
    verdicts = {f"{mode}, {v}: median {v} / off <= {TARGET} (router process)": {
        "value": d[f"ratio_{v}_over_off"]["p50"], "pass": d[f"ratio_{v}_over_off"]["p50"] <= TARGET}
        for mode, d in out.items() for v in TRACED}
    bad = [f"{c['target']}/{c['mode']}/round {c['round']}" for c in cells if c["errors_total"] or c["stalled"]]
    return {"modes": out, "verdicts": verdicts, "cells_with_errors": bad,
            "contended_cells": [f"{c['target']}/{c['mode']}/round {c['round']}" for c in cells if c["contended"]]}


def draw(result: dict, path: Path) -> None:
    from matplotlib import ticker

    modes = list(result["derived"]["modes"])
    fig, axes = pyplot().subplots(1, 2, figsize=(13, 5))
    colors = {"plain": "#1f77b4", "stream": "#ff7f0e"}
    for mode in modes:
        cells = [c for c in result["cells"] if c["mode"] == mode]
        for variant, (marker, line) in zip(VARIANTS, (("o", ":"), ("^", "-"), ("s", "--")), strict=True):
            for part, fill in (("router", "full"), ("sum", "none")):
                if variant == "off" and part == "sum":
                    continue
                mine = sorted((c["round"], ms(c, part)) for c in cells if c["target"] == variant)
                axes[0].plot([r for r, _ in mine], [v for _, v in mine], marker=marker, fillstyle=fill,
                             color=colors[mode], linestyle=line, label=f"{mode}, tracing {LABELS[variant]}"
                             + (", with its exporter" if part == "sum" else ""))
        for variant, marker in zip(TRACED, ("^", "s"), strict=True):
            for tail, fill in (("", "full"), ("_sum", "none")):
                ratios = result["derived"]["modes"][mode][f"ratio_{variant}{tail}_per_round"]
                axes[1].plot(range(len(ratios)), ratios, marker=marker, fillstyle=fill, color=colors[mode],
                             label=f"{mode}, {LABELS[variant]}" + (", with its exporter" if tail else ""))
    axes[0].set_title("CPU ms per request: router process (filled), with its exporter (hollow)")
    axes[0].set_xlabel("round")
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    axes[1].axhline(TARGET, color="red", linestyle="--", label=f"target {TARGET}")
    axes[1].axhline(1.0, color="#9e9e9e", linewidth=0.8)
    axes[1].set_title("Tracing on / off, CPU per request, per round (log; hollow: with its exporter)")
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(ticker.ScalarFormatter())
    axes[1].yaxis.set_minor_formatter(ticker.ScalarFormatter())
    axes[1].set_xlabel("round")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    s = result["settings"]
    fig.suptitle(f"Tracing's CPU cost in the router, FAKE workers, concurrency {s['concurrency']} "
                 f"({stamp(result['machine'])})")
    save(fig, path)


def table(result: dict) -> str:
    """bench/README.md's table (bench/tables.py): off's CPU per request, and each traced router's over it: the
    router process's, and (results made since the exporter process) with its exporter process's."""
    s, rows = result["settings"], []
    summed = all("ratio_on_sum_over_off" in d for d in result["derived"]["modes"].values())
    ratios = [f"{v}{tail}" for tail in ("", "_sum")[:1 + summed] for v in TRACED]
    for mode, d in result["derived"]["modes"].items():
        cells = ["{p50:.2f} ({p10:.2f}-{p90:.2f})".format(**d[f"ratio_{r}_over_off"]) for r in ratios]
        rows.append(f"| {mode} | {d['cpu_ms_per_request_off']['p50']:.3f} | " + " | ".join(cells) + " |")
    head = ["mode", "off: CPU ms per request", "on / off", "1% sampled / off"]
    head += ["on, with its exporter / off", "1% sampled, with its exporter / off"] if summed else []
    return (f"{s['rounds']} rounds, concurrency {s['concurrency']}, FAKE workers; medians (p10-p90) over rounds:\n\n"
            f"| {' | '.join(head)} |\n|{'---|' * len(head)}\n" + "\n".join(rows))


def requests_answered(proc: procs.Proc) -> int:
    _, body = procs.request(proc.port, "GET", "/metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                   if line.startswith("pdcluster_router_requests_total{")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing.cost", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each measuring every router (default 6)")
    parser.add_argument("--duration", type=int, default=3, help="measured seconds per cell (default 3)")
    parser.add_argument("--concurrency", type=int, default=32, help="wrk connections (default 32)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where tracing-cost.json and .png go")
    loadgen.cell_options(parser)
    args = parser.parse_args(argv)
    logs, machine = loadgen.prepare(args, "bench-tracing-")
    started: list[procs.Proc] = []
    cells: list[dict] = []
    with Receiver(keep=False, nice=19) as collector:
        try:
            fakes = procs.start_fakes(logs, args.chunks)
            started += fakes
            pair = procs.as_workers(*fakes)
            env = collector.exporter_env()
            routers = {v: procs.start_ours(f"router_{v}", logs, [pair[0]], [pair[1]],
                                           settings={"tracing": v != "off"}, env={**env, **own})
                       for v, own in VARIANTS.items()}
            started += routers.values()
            for name, proc in routers.items():
                procs.wait_ready(proc, lambda p=proc: procs.generate_ok(p.port), 60)
                loadgen.sanity_check(f"router_{name}", proc.port, args.chunks)
            # measure's target is the router process alone; its children (the exporter) are counted apart.
            watched = {"fake_prefill": fakes[0], "fake_decode": fakes[1],
                       **{f"router_{v}": Part(p, children=False) for v, p in routers.items()},
                       **{f"exporter_{v}": Part(routers[v], children=True) for v in TRACED}}
            print(f"{'round':>5} {'mode':7} {'tracing':8} {'requests':>9} {'req/s':>8} {'CPU ms/req':>11} "
                  f"{'exporter':>9} {'sum':>8}", flush=True)
            order = list(VARIANTS)
            for r in range(args.rounds):
                for mode in args.modes:
                    for variant in order[r % len(order):] + order[:r % len(order)]:
                        cell = add_parts(loadgen.measure(variant, routers[variant].port, args.concurrency, mode, args,
                                                 watched), variant)
                        cells.append({**cell, "round": r})
                        print(f"{r:>5} {mode:7} {variant:8} {cell['requests']:>9} {cell['req_per_s']:>8.0f} "
                              f"{cell['target_cpu_ms_per_request']:>11.4f} {cell['exporter_cpu_ms_per_request']:>9.4f} "
                              f"{cell['sum_cpu_ms_per_request']:>8.4f}", flush=True)
            answered = {v: requests_answered(routers[v]) for v in TRACED}
            for v in TRACED:
                routers[v].stop()  # it sends what it still holds as it stops
        finally:
            for proc in reversed(started):
                proc.stop()
        spans = collector.count
    result = {
        "benchmark": "the router's CPU per request with tracing off and on (OTLP/HTTP to an in-process receiver), "
                     "its process's and its exporter process's, on FAKE SGLang workers",
        "settings": {"rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
                     "concurrency": args.concurrency, "modes": args.modes, "chunks_per_stream": args.chunks,
                     "router_processes": 1, "load_generator": "wrk -t1, closed loop", "target_ratio": TARGET,
                     "exporter": "the router's exporter process (router/tracing/export.py): OTLP/HTTP protobuf, the "
                                 "SDK's BatchSpanProcessor at its defaults"},
        "machine": {**machine, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "cells": cells, "derived": derive(cells, args.modes),
        # Every request of `on` and 1% of `sampled`'s make SPANS_PER_REQUEST spans: fewer means some were dropped.
        "spans": {"requests": answered, "received": spans, "expected": round(SPANS_PER_REQUEST * (
            answered.get("on", 0) + answered.get("sampled", 0) * float(SAMPLED["OTEL_TRACES_SAMPLER_ARG"])))},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing-cost.json").write_text(json.dumps(result, indent=2) + "\n")
    draw(result, args.out / "tracing-cost.png")
    for mode, d in result["derived"]["modes"].items():
        print(f"{mode}: CPU ms/request (median) " + ", ".join(
            f"{LABELS[v]} {d[f'cpu_ms_per_request_{v}']['p50']}" for v in VARIANTS))
        print("  with the exporter process: " + ", ".join(
            f"{LABELS[v]} {d[f'cpu_ms_per_request_{v}_sum']['p50']}" for v in TRACED))
        for v in TRACED:
            for tail, what in (("", "router process"), ("_sum", "with its exporter")):
                r = d[f"ratio_{v}{tail}_over_off"]
                print(f"  {LABELS[v]} / off, {what}: p10 {r['p10']}, p50 {r['p50']}, p90 {r['p90']} "
                      f"(pooled {d[f'ratio_{v}{tail}_pooled']})")
    print(f"spans received {spans}, expected ~{result['spans']['expected']}")
    loadgen.print_verdicts(result["derived"]["verdicts"])
    print(f"bench: wrote {args.out / 'tracing-cost.json'} and .png (FAKE workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
