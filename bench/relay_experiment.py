"""`python -m bench.relay_experiment`: what holds our router back? A separate experiment, router/ untouched.

On the same FAKE workers and with the same wrk load as bench.router, it measures the real router next to minimal
PD relays (bench/relay.py) that differ only in their HTTP server and client: FastAPI on uvicorn (h11 or
httptools, FastAPI's built-in OpenTelemetry hooks on or off), a bare ASGI function on uvicorn, or aiohttp's server,
with httpx, httpx2 (pydantic's fork with a reworked connection pool), aiohttp's ClientSession, pyreqwest (Rust's
reqwest) or the router's own client (router/upstream.py) as the client; and SGLang's Rust router ("sglang"). Writes bench/results/relay_experiment.json and prints a table.

"router" is the router as the working tree runs it (its own uvicorn protocol and HTTP client, one process).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import procs, report
from bench.router import RESULTS, measure, print_header, print_row, wait_for_quiet

# name -> (server, client); "router" is the real one (python -m router), "direct" is the decode itself.
VARIANTS = {
    "direct": None,
    "router": ("router", None),
    "fastapi+httpx": ("fastapi", "httpx"),
    "fastapi+httpx2": ("fastapi", "httpx2"),
    "fastapi+aiohttp": ("fastapi", "aiohttp"),
    "fastapi-httptools+aiohttp": ("fastapi-httptools", "aiohttp"),
    "fastapi-notelemetry+aiohttp": ("fastapi-notelemetry", "aiohttp"),
    "fastapi-httptools-notelemetry+aiohttp": ("fastapi-httptools-notelemetry", "aiohttp"),
    "aiohttp+aiohttp": ("aiohttp", "aiohttp"),
    "asgi+aiohttp": ("asgi-httptools", "aiohttp"),
    "asgi+pyreqwest": ("asgi-httptools", "pyreqwest"),
    "asgi+upstream": ("asgi-httptools", "upstream"),
    "sglang": ("sglang", None),
}


def start_variant(name: str, logs: Path, prefill: procs.Proc, decode: procs.Proc):
    server, client = VARIANTS[name]
    if server == "sglang":
        return procs.start_sglang(logs, prefill, decode)
    if server == "router":
        return procs.start_ours(logs, prefill, decode)
    port = procs.free_port()
    argv = [sys.executable, "-m", "bench.relay", "--server", server, "--client", client, "--port", str(port),
            "--prefill", prefill.url, "--decode", decode.url]
    return procs.start(f"relay_{name}", argv, logs, port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_experiment", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--duration", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--modes", nargs="+", default=["plain", "stream"], choices=["plain", "stream"])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "relay_experiment.json")
    parser.add_argument("--quiet-wait", type=float, default=60, help="wait up to this long for an idle machine")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    machine = report.machine()
    machine["cores_busy_before_start"] = wait_for_quiet(args.quiet_wait)
    prefill, decode = procs.start_fake("fake_prefill", logs, args.chunks), procs.start_fake("fake_decode", logs,
                                                                                           args.chunks)
    cells = []
    try:
        for fake in (prefill, decode):
            procs.wait_ready(fake, lambda f=fake: procs.request(f.port, "GET", "/health")[0] == 200, 30)
        print_header()
        for name in args.variants:  # one variant at a time: only the fakes and that relay are running
            proc = None if name == "direct" else start_variant(name, logs, prefill, decode)
            try:
                port = decode.port
                if proc is not None:
                    procs.wait_ready(proc, lambda p=proc: procs.generate_ok(p.port), 60)
                    port = proc.port
                watched = {"fake_prefill": prefill, "fake_decode": decode, **({f"router_{name}": proc} if proc else {})}
                for conc in args.concurrency:
                    for mode in args.modes:
                        cells.append(measure(name, port, conc, mode, args, watched))
                        print_row(cells[-1])
            finally:
                if proc is not None:
                    proc.stop()
    finally:
        decode.stop()
        prefill.stop()
    direct = {(c["concurrency"], c["mode"]): c for c in cells if c["target"] == "direct"}
    for cell in cells:
        base = direct.get((cell["concurrency"], cell["mode"]))
        if base and cell["target"] != "direct":
            cell["added_ms"] = {q: report._diff(cell["latency_ms"][q], base["latency_ms"][q]) for q in ("p50", "p99")}
    # The comparison that survives a shared machine best: the relay's own CPU time per request, per cell.
    summary = {}
    for cell in cells:
        row = summary.setdefault(cell["target"], {})
        row[f"c{cell['concurrency']}/{cell['mode']}"] = {"cpu_ms_per_request": cell["target_cpu_ms_per_request"],
                                                         "req_per_s": cell["req_per_s"],
                                                         "p50_ms": cell["latency_ms"]["p50"]}
    print("\nCPU ms per request (the relay's own; for direct, the fake decode's):")
    columns = list(next(iter(summary.values()), {}))
    print(f"{'variant':28}" + "".join(f"{c:>13}" for c in columns))
    for name, row in summary.items():
        print(f"{name:28}" + "".join(f"{str(row[c]['cpu_ms_per_request']):>13}" for c in columns))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "experiment": "minimal PD relays vs our router, on fake workers (bench/relay.py)",
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "chunks_per_stream": args.chunks,
                     "variants": {v: VARIANTS[v] for v in args.variants}},
        "machine": {**machine, "git_commit_at_end": report.git("rev-parse", "HEAD")},
        "date_end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "summary_cpu_ms_per_request": summary, "cells": cells,
    }, indent=2) + "\n")
    print(f"relay_experiment: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
