"""`python -m bench.router`: our PD router against direct access and SGLang's Rust router, on FAKE workers.

One run starts two fake SGLang workers (a prefill and a decode, bench/fake_worker.py), our router
(`python -m router`) and SGLang's Rust router in PD mode over the same pair, then for each concurrency and mode
(plain / streamed /generate) drives each target with wrk: the decode directly, our router, SGLang's router.
It writes bench/results/router.json (every cell, the derived ratios and verdicts, the machine) and router.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import idle, loadgen, procs, report, router_plot

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDED_CORES = 0.3  # a cell where processes outside the benchmark used more CPU than this is flagged


def wait_for_quiet(max_wait: float) -> float:
    """Wait (up to max_wait s) until the machine is nearly idle; return the cores busy at the last look."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = idle.busy_cores(2.0)
        if busy < CONTENDED_CORES or time.monotonic() >= deadline:
            return round(busy, 3)
        print(f"bench: the machine is busy ({busy:.2f} cores used by others); waiting for it to calm down",
              flush=True)


def settle(watched: dict[str, procs.Proc], max_wait: float = 10.0) -> float:
    """After a cell, wait until the processes under test are idle again (a router may still be working off requests
    the load generator gave up on), so that the next cell does not pay for this one. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait:
        before = sum(p.cpu_seconds() for p in watched.values())
        time.sleep(0.5)
        if sum(p.cpu_seconds() for p in watched.values()) - before < 0.05 * 0.5 * len(watched):
            break
    return round(time.monotonic() - started, 2)


def sanity_check(target: str, port: int, chunks: int) -> None:
    """One plain and one streamed request, checked in full, before any load."""
    status, body = procs.request(port, "POST", "/generate", loadgen.body_for(False, chunks).encode())
    answer = json.loads(body) if status == 200 else {}
    if not {"text", "output_ids", "meta_info"} <= set(answer):
        raise RuntimeError(f"{target}: plain /generate answered {status} {body[:200]!r}")
    status, body = procs.request(port, "POST", "/generate", loadgen.body_for(True, chunks).encode())
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    if status != 200 or len(events) != chunks + 1 or events[-1] != "data: [DONE]":
        raise RuntimeError(f"{target}: streamed /generate answered {status}, {len(events)} events: {body[:200]!r}")


def measure(name: str, port: int, conc: int, mode: str, args, watched: dict[str, procs.Proc]) -> dict:
    stream = mode == "stream"
    body, url = loadgen.body_for(stream, args.chunks), f"http://{procs.HOST}:{port}"
    if args.warmup:
        loadgen.run(url, "/generate", body, stream, conc, args.warmup)
    settled = settle(watched)
    before_cpu = {k: p.cpu_seconds() for k, p in watched.items()}
    before_up = {k: procs.fake_generate_count(watched[k]) for k in ("fake_prefill", "fake_decode")}
    before_busy, started = idle.busy_cpu_seconds(), time.monotonic()
    raw = loadgen.run(url, "/generate", body, stream, conc, args.duration)
    wall = time.monotonic() - started
    busy = idle.busy_cpu_seconds() - before_busy
    cell = {"target": name, "concurrency": conc, "mode": mode, **loadgen.summarize(raw, stream)}
    cores = {k: round((p.cpu_seconds() - before_cpu[k]) / wall, 3) for k, p in watched.items()}
    cores["wrk"] = round(raw["cpu_seconds"] / wall, 3)
    cores["machine_total"] = round(busy / wall, 3)
    cores["everything_else"] = round(max(0.0, cores["machine_total"] - sum(
        v for k, v in cores.items() if k not in ("machine_total",))), 3)
    cell["cpu_cores"] = cores
    own = cores.get(f"router_{name}", cores["fake_decode"] if name == "direct" else None)
    # CPU the target itself spent per request: steadier than wall-clock numbers when the machine is shared.
    cell["target_cpu_ms_per_request"] = round(1000 * own * wall / max(cell["requests"], 1), 3) if own else None
    cell["contended"] = cores["everything_else"] > CONTENDED_CORES
    # /generate calls the fakes got during the measured window: both halves of every routed request.
    cell["upstream_generate_calls"] = {k: procs.fake_generate_count(watched[k]) - before_up[k] for k in before_up}
    cell["settle_s"] = {"after_warmup": settled, "after": settle(watched)}
    return cell


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
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured seconds before each cell (default 1)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--modes", nargs="+", default=["plain", "stream"], choices=["plain", "stream"])
    parser.add_argument("--targets", nargs="+", default=list(report.TARGETS), choices=report.TARGETS)
    parser.add_argument("--chunks", type=int, default=16, help="SSE chunks per streamed answer (default 16)")
    parser.add_argument("--router-workers", type=int, default=os.cpu_count(),
                        help="our router's processes (default: one per core; SGLang's router runs its default runtime)")
    parser.add_argument("--router-log-level", default="warning", help="our router's log_level (default warning)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where router.json and router.png go")
    parser.add_argument("--quiet-wait", type=float, default=30,
                        help="wait up to this many seconds for other work on the machine to stop (default 30)")
    args = parser.parse_args(argv)
    loadgen.wrk_path()
    busy_before = wait_for_quiet(args.quiet_wait)
    logs = Path(tempfile.mkdtemp(prefix="bench-router-"))
    print(f"bench: process logs in {logs}", flush=True)
    machine = report.machine()
    machine["wrk"] = loadgen.wrk_version()
    machine["cores_busy_before_start"] = busy_before
    started: list[procs.Proc] = []
    try:
        prefill = procs.start_fake("fake_prefill", logs, args.chunks)
        decode = procs.start_fake("fake_decode", logs, args.chunks)
        started += [prefill, decode]
        for fake in (prefill, decode):
            procs.wait_ready(fake, lambda f=fake: procs.request(f.port, "GET", "/health")[0] == 200, 30)
        ports, startup = {"direct": decode.port}, {}
        # The fake prefill's KV bootstrap port is only passed along by the routers: nothing listens there.
        pair = procs.Worker(prefill.name, prefill.url, procs.BOOTSTRAP_PORT), procs.Worker(decode.name, decode.url)
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
            sanity_check(name, ports[name], args.chunks)
        watched = {"fake_prefill": prefill, "fake_decode": decode, **{f"router_{k}": v for k, v in launched.items()}}
        cells = []
        print_header()
        for conc in args.concurrency:
            for mode in args.modes:
                for name in args.targets:
                    cells.append(measure(name, ports[name], conc, mode, args, watched))
                    print_row(cells[-1])
    finally:
        for proc in reversed(started):
            proc.stop()
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["git_commit_at_end"] = report.git("rev-parse", "HEAD")  # differs if the code changed during the run
    result = {
        "benchmark": "pdcluster router vs direct vs SGLang Rust router (PD mode), on fake SGLang workers",
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "concurrency": args.concurrency,
                     "modes": args.modes, "chunks_per_stream": args.chunks, "path": "/generate",
                     "load_generator": "wrk -t1, closed loop, one request in flight per connection",
                     "our_router_log_level": args.router_log_level, "our_router_workers": args.router_workers,
                     "sglang_router_threads": "its default"},
        "machine": machine, "startup_s": startup, "cells": cells, "derived": report.derive(cells),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    router_plot.draw(result, args.out / "router.png")
    print("\nverdicts:")
    for name, v in result["derived"]["verdicts"].items():
        print(f"  {'PASS' if v['pass'] else 'FAIL'}  {name}: {v['value']} (target {v['target']})")
    print(f"\nbench: wrote {args.out / 'router.json'} and {args.out / 'router.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
