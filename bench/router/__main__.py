"""`python -m bench.router`: our PD router against direct access and SGLang's Rust router, on FAKE workers.

One run starts two fake SGLang workers (a prefill and a decode, bench/harness/fake_worker.py), our router
(`python -m router`) and SGLang's Rust router in PD mode over the same pair, then for each concurrency and mode
(plain / streamed /generate) drives each target with wrk: the decode directly, our router, SGLang's router.
It writes bench/results/router.json (every cell, the derived ratios and verdicts, the machine) and router.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.harness import loadgen, machine, procs
from bench.harness.paths import RESULTS
from bench.router import plot, report


def print_header() -> None:
    print(f"{'target':8} {'conc':>5} {'mode':7} {'requests':>9} {'err':>4} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'p99 ms':>8} {'req/s':>9} {'chunks/s':>10} {'CPU':>5}", flush=True)


def print_row(c: dict) -> None:
    lat, cpu = {k: v if v is not None else float("nan") for k, v in c["latency_ms"].items()}, c["cpu_cores"]
    busy = cpu.get(f"router_{c['target']}", cpu.get("fake_decode"))  # cores used by the target itself
    print(f"{c['target']:8} {c['concurrency']:>5} {c['mode']:7} {c['requests']:>9} {c['errors_total']:>4} "
          f"{lat['p50']:>8.3f} {lat['p90']:>8.3f} {lat['p99']:>8.3f} {c['req_per_s']:>9.1f} "
          f"{c['chunks_per_s'] or 0:>10.0f} {busy:>5.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="measured seconds per cell (default 5)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--targets", nargs="+", default=list(report.TARGETS), choices=report.TARGETS)
    parser.add_argument("--router-workers", type=int, default=os.cpu_count(),
                        help="our router's processes (default: one per core; SGLang's router runs its default runtime)")
    parser.add_argument("--router-log-level", default="warning", help="our router's log_level (default warning)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where router.json and router.png go")
    loadgen.cell_options(parser)
    args = parser.parse_args(argv)
    logs, measured_on = loadgen.prepare(args, "bench-router-")
    started: list[procs.Proc] = []
    try:
        prefill, decode = procs.start_fakes(logs, args.chunks)
        started += [prefill, decode]
        ports, startup = {"direct": decode.port}, {}
        pair = procs.as_workers(prefill, decode)
        routers = {"ours": lambda: procs.start_ours("router_ours", logs, [pair[0]], [pair[1]],
                                                     log_level=args.router_log_level, workers=args.router_workers),
                   "sglang": lambda: procs.start_sglang(logs, *pair)}
        launched = {name: routers[name]() for name in args.targets if name in routers}
        started += launched.values()
        for name, proc in launched.items():
            startup[name] = round(procs.wait_ready(proc, lambda p=proc: procs.generate_ok(p.port), 120), 2)
            ports[name] = proc.port
        print(f"bench: ready (seconds to first answer: {startup})", flush=True)
        for name in args.targets:
            loadgen.sanity_check(name, ports[name], args.chunks)
        watched = {"fake_prefill": prefill, "fake_decode": decode, **{f"router_{k}": v for k, v in launched.items()}}
        cells = []
        print_header()
        for conc in args.concurrency:
            for mode in args.modes:
                for name in args.targets:
                    cells.append(loadgen.measure(name, ports[name], conc, mode, args, watched))
                    print_row(cells[-1])
    finally:
        for proc in reversed(started):
            proc.stop()
    measured_on["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    measured_on["git_commit_at_end"] = machine.git("rev-parse", "HEAD")  # differs if the code changed during the run
    result = {
        "benchmark": "pdcluster router vs direct vs SGLang Rust router (PD mode), on fake SGLang workers",
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "concurrency": args.concurrency,
                     "modes": args.modes, "chunks_per_stream": args.chunks, "path": "/generate",
                     "load_generator": "wrk -t1, closed loop, one request in flight per connection",
                     "our_router_log_level": args.router_log_level, "our_router_workers": args.router_workers,
                     "sglang_router_threads": "its default"},
        "machine": measured_on, "startup_s": startup, "cells": cells, "derived": report.derive(cells),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    plot.draw(result, args.out / "router.png")
    print("\nverdicts:")
    loadgen.print_verdicts(result["derived"]["verdicts"])
    print(f"\nbench: wrote {args.out / 'router.json'} and {args.out / 'router.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
