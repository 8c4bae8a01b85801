"""`python -m bench.store`: what the Responses store adds to a turn at the router, side by side with `store: false`, on
FAKE workers.

Two fake SGLang workers (bench/harness/fake_worker.py: they answer at once, so the client's latency is the router's
own), a real PostgreSQL (bench/harness/postgres.py, at its durable defaults) and two one-process routers over the
fakes: one whose store is SQLite on local disk (it serves `store: false` and `store: true` on SQLite), one on the
PostgreSQL. Each round runs every cell (workload plain or chain, bench/store/load.py; concurrency 1 and 8; the three
modes, which goes first rotating), so that noise hits all alike. It writes bench/results/store.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import cpu, procs
from bench.harness.machine import machine
from bench.harness.paths import RESULTS
from bench.harness.postgres import PostgresServer
from bench.store import load, report


def start_routers(logs: Path, postgres: PostgresServer, started: dict[str, procs.Proc]) -> None:
    """The fakes, then a router on each store, into `started` as each starts (the caller stops them all)."""
    fakes = procs.start_fakes(logs, load.OUTPUT_TOKENS)
    started.update(fake_prefill=fakes[0], fake_decode=fakes[1])
    prefill, decode = procs.as_workers(*fakes)
    stores = {"sqlite": {"backend": "sqlite", "url": f"sqlite+aiosqlite:///{logs / 'responses.db'}"},
              "postgresql": {"backend": "postgresql", "url": postgres.url()}}
    for name, store in stores.items():
        started[name] = procs.start_ours(f"router_{name}", logs, [prefill], [decode], settings={"store": store})
    for name in stores:
        procs.wait_ready(started[name], lambda p=started[name]: procs.generate_ok(p.port), 60)


def measure(url: str, mode: str, workload: str, concurrency: int, args: argparse.Namespace,
            pids: dict[str, int]) -> dict:
    """One cell after its unmeasured warm-up: the turns' latency, the CPU the router under test and the PostgreSQL
    server spent per turn (steadier than latency on a shared machine), and the cores the rest of the machine used
    meanwhile (`pids`: the roots of this benchmark's process trees, itself included)."""
    store = mode != "off"
    asyncio.run(load.run_cell(url, store, workload, concurrency, args.warmup))
    before = {name: procs.tree_cpu_seconds(pid) for name, pid in pids.items()}
    before_busy, started = cpu.busy_cpu_seconds(), time.monotonic()
    cell = asyncio.run(load.run_cell(url, store, workload, concurrency, args.duration))
    wall = time.monotonic() - started
    used = {name: procs.tree_cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    others = cpu.busy_cpu_seconds() - before_busy - sum(used.values())
    turns = max(len(cell.latencies_ms), 1)
    router = used["postgresql" if mode == "postgresql" else "sqlite"]
    return {"mode": mode, "workload": workload, "concurrency": concurrency, "requests": len(cell.latencies_ms),
            "errors": cell.errors, "errors_total": sum(cell.errors.values()), "duration_s": round(wall, 3),
            "req_per_s": round(len(cell.latencies_ms) / wall, 1), "latency_ms": report.latency(cell.latencies_ms),
            "router_cpu_ms_per_turn": round(1000 * router / turns, 3),
            "postgres_cpu_ms_per_turn": round(1000 * used["postgres"] / turns, 3),
            "cores_used_by_others": round(max(0.0, others / wall), 3),
            "contended": others / wall > cpu.CONTENDED_CORES}


def run_rounds(started: dict[str, procs.Proc], postgres: PostgresServer, args: argparse.Namespace) -> list[dict]:
    urls = {"off": started["sqlite"].url, "sqlite": started["sqlite"].url, "postgresql": started["postgresql"].url}
    assert postgres.process is not None
    pids = {"bench": os.getpid(), "postgres": postgres.process.pid, **{n: p.popen.pid for n, p in started.items()}}
    cells: list[dict] = []
    print(f"{'round':>5} {'workload':8} {'conc':>4} {'mode':10} {'turns':>6} {'err':>4} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'CPU ms':>6} {'others':>6}", flush=True)
    order = list(report.MODES)
    for r in range(args.rounds):
        for concurrency in args.concurrency:
            for workload in load.WORKLOADS:
                for mode in order[r % len(order):] + order[:r % len(order)]:
                    cell = {**measure(urls[mode], mode, workload, concurrency, args, pids), "round": r}
                    cells.append(cell)
                    lat = cell["latency_ms"]
                    print(f"{r:>5} {workload:8} {concurrency:>4} {mode:10} {cell['requests']:>6} "
                          f"{cell['errors_total']:>4} {lat['p50'] or float('nan'):>7.2f} "
                          f"{lat['p99'] or float('nan'):>7.2f} {cell['router_cpu_ms_per_turn']:>6.2f} "
                          f"{cell['cores_used_by_others']:>6.2f}", flush=True)
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each measuring every cell (default 5)")
    parser.add_argument("--duration", type=float, default=2.5, help="measured seconds per cell (default 2.5)")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each cell (default 0.5)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="clients (default 1 8)")
    parser.add_argument("--quiet-wait", type=float, default=30,
                        help="wait up to this many seconds for other work on the machine to stop (default 30)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where store.json and .png go")
    args = parser.parse_args(argv)
    busy_before = cpu.wait_for_quiet(args.quiet_wait)
    logs = Path(tempfile.mkdtemp(prefix="bench-store-"))
    print(f"bench: FAKE workers (bench/harness/fake_worker.py); client latency; process logs in {logs}", flush=True)
    measured_on = {**machine(), "cores_busy_before_start": busy_before}
    postgres = PostgresServer(durable=True)
    started: dict[str, procs.Proc] = {}
    try:
        postgres.start()
        start_routers(logs, postgres, started)
        cells = run_rounds(started, postgres, args)
    finally:
        for proc in reversed(started.values()):
            proc.stop()
        postgres.stop()
    result = {
        "benchmark": "what the Responses store (store: true, SQLite or PostgreSQL) adds to a turn at the router, side "
                     "by side with store: false, on FAKE SGLang workers; latency as the client measures it",
        "settings": {"rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
                     "concurrency": args.concurrency, "workloads": list(load.WORKLOADS),
                     "chain_turns": load.CHAIN_TURNS, "output_tokens": load.OUTPUT_TOKENS, "router_processes": 1,
                     "load_generator": f"httpx {__import__('httpx').__version__}, closed loop, in this process",
                     "latency": "client-measured, request sent to answer read; the fake workers answer at once",
                     "sqlite": "the router's own settings: WAL, synchronous=NORMAL, a file on local disk",
                     "postgresql": f"Debian's {postgres.bin.parent.name}, its defaults (fsync, synchronous_commit "
                                   "on), over a unix socket", "target_added_p50_ms": report.TARGET_MS},
        "machine": {**measured_on, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "cells": cells, "derived": report.derive(cells),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store.json").write_text(json.dumps(result, indent=2) + "\n")
    report.draw(result, args.out / "store.png")
    print(report.table(result))
    for name, v in result["derived"]["verdicts"].items():
        print(f"  {'PASS' if v['pass'] else 'FAIL'}  {name}: {v['value']}")
    print(f"bench: wrote {args.out / 'store.json'} and .png (FAKE workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
