"""`python -m bench.tracing.instructions`: the router's instructions per request with tracing off, on and 1% sampled,
counted by valgrind's callgrind, and the floor a traced request's record cannot go below in CPython.

Why instructions: tracing's target is 5% of the router's CPU per request, and CPU time on this 2-core VM moves 20-30%
between identical runs (`make bench-tracing`'s ratios carry that noise); the VM exposes no hardware counters. Under
callgrind the count of a request is the same run to run within ~1%. Instructions are not time (caches, branches), so
this complements `make bench-tracing`; it does not replace it.

The routers of `make bench-tracing` (one process each, on the fake workers, exporting OTLP/HTTP to a receiver at
nice 19), each under `valgrind --tool=callgrind` with counting off until it has answered a warm-up; then per mode and
round, counting on for --duration seconds of wrk, off, dumped: the router process's instructions (its exporter child
runs natively, uncounted) over the requests it answered meanwhile. The floor: FLOOR below, the bare record of a traced
request (5 random ids, 8 timestamps, 2 `traceparent` headers, one flat tuple for its 4 spans, pickled 64 at a time),
with no attribute, sampler or context; counted the same way, as a share of an untraced request. It writes
bench/results/tracing-instructions.json and .png.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import loadgen, machine, procs
from bench.harness.otlp_receiver import Receiver
from bench.harness.paths import RESULTS
from bench.harness.plot import pyplot, save, stamp
from bench.tracing.cost import LABELS, TARGET, VARIANTS, percentile, requests_answered

FLOOR = """
import pickle, sys
from random import getrandbits
from time import time_ns
batch = []
for _ in range(int(sys.argv[1])):
    t0 = time_ns(); trace = getrandbits(128); root, attempt = getrandbits(64), getrandbits(64)
    prefill, decode = getrandbits(64), getrandbits(64)
    t1 = time_ns(); t2 = time_ns(); t3 = time_ns()
    head = f"00-{trace:032x}-"
    prefill_headers = {"traceparent": f"{head}{prefill:016x}-01"}
    decode_headers = {"traceparent": f"{head}{decode:016x}-01"}
    t4 = time_ns(); t5 = time_ns(); t6 = time_ns(); t7 = time_ns()
    batch.append((trace, root, t0, t7, 200, "request-id", attempt, t1, t6, "prefill-0", "decode-0", 1234, "ok",
                  prefill, t2, t4, 200, decode, t3, t5, 200))
    if len(batch) == 64:
        pickle.dumps(batch, protocol=5)
        batch = []
"""


def tools() -> tuple[str, str]:
    found = shutil.which("valgrind"), shutil.which("callgrind_control")
    if None in found:
        raise SystemExit("bench: valgrind is not installed (Debian: apt-get install valgrind)")
    return found  # type: ignore[return-value]


def floor(valgrind: str, loops: tuple[int, int] = (10_000, 30_000)) -> float:
    """FLOOR's instructions per loop: two runs of different lengths, so that the interpreter's start cancels out."""
    counts = []
    for n in loops:
        out = subprocess.run([valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c",
                              FLOOR, str(n)], capture_output=True, text=True, check=True)
        counts.append(int(re.search(r"Collected : (\d+)", out.stderr).group(1)))  # type: ignore[union-attr]
    return (counts[1] - counts[0]) / (loops[1] - loops[0])


def start_router(name: str, logs: Path, valgrind: str, fakes: list[procs.Proc], env: dict[str, str]) -> procs.Proc:
    """`python -m router` over the fakes, under callgrind, counting off."""
    prefill, decode = procs.as_workers(*fakes)
    return procs.start_ours(f"router_{name}", logs, [prefill], [decode], settings={"tracing": name != "off"}, env=env,
                            wrapper=(valgrind, "--tool=callgrind", "--instr-atstart=no",
                                     f"--callgrind-out-file={logs}/callgrind.{name}"))


def count(proc: procs.Proc, control: str, logs: Path, name: str, mode: str, seconds: float, concurrency: int) -> dict:
    """One cell: counting on for `seconds` of wrk, then the dump's instructions over the requests answered."""
    pid = str(proc.popen.pid)
    before = requests_answered(proc)
    subprocess.run([control, "--instr=on", pid], check=True, capture_output=True)
    loadgen.run(f"http://{procs.HOST}:{proc.port}", "/generate", loadgen.body_for(mode == "stream", 16),
                mode == "stream", concurrency, seconds, timeout=60)
    subprocess.run([control, "--instr=off", pid], check=True, capture_output=True)
    requests = requests_answered(proc) - before
    dumps = set(logs.glob(f"callgrind.{name}.*"))
    subprocess.run([control, "--dump", pid], check=True, capture_output=True)  # and zeroes the counts
    (new,) = set(logs.glob(f"callgrind.{name}.*")) - dumps
    instructions = int(re.search(r"^totals: (\d+)", new.read_text(), re.M).group(1))  # type: ignore[union-attr]
    return {"variant": name, "mode": mode, "requests": requests, "instructions": instructions,
            "per_request": round(instructions / requests)}


def derive(cells: list[dict], modes: list[str], floor_per_loop: float) -> dict:
    out: dict = {"modes": {}}
    for mode in modes:
        mine = {v: [c for c in cells if (c["mode"], c["variant"]) == (mode, v)] for v in VARIANTS}
        rounds = range(len(mine["off"]))
        d: dict = {f"per_request_{v}": round(percentile([c["per_request"] for c in mine[v]], 50)) for v in VARIANTS}
        for v in ("on", "sampled"):
            ratios = [mine[v][r]["per_request"] / mine["off"][r]["per_request"] for r in rounds]
            d[f"ratio_{v}_over_off"] = round(percentile(ratios, 50), 4)
            d[f"ratio_{v}_per_round"] = [round(x, 4) for x in ratios]
        d["added_by_tracing"] = d["per_request_on"] - d["per_request_off"]
        d["floor_share_of_off"] = round(floor_per_loop / d["per_request_off"], 4)
        out["modes"][mode] = d
    out["verdicts"] = {f"{mode}, {v}: instructions {v} / off <= {TARGET}": {
        "value": d[f"ratio_{v}_over_off"], "pass": d[f"ratio_{v}_over_off"] <= TARGET}
        for mode, d in out["modes"].items() for v in ("on", "sampled")}
    return out


def draw(result: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(9, 5))
    modes, width = list(result["derived"]["modes"]), 0.25
    for i, v in enumerate(VARIANTS):
        values = [result["derived"]["modes"][m][f"per_request_{v}"] / 1000 for m in modes]
        ax.bar([x + (i - 1) * width for x in range(len(modes))], values, width, label=f"tracing {LABELS[v]}")
    for x, m in enumerate(modes):
        off = result["derived"]["modes"][m]["per_request_off"] / 1000
        ax.hlines(off * TARGET, x - 1.5 * width, x + 1.5 * width, colors="red", linestyles="--",
                  label=f"target: off x {TARGET}" if x == 0 else None)
        ax.hlines(off + result["floor_per_request"] / 1000, x - 1.5 * width, x + 1.5 * width, colors="black",
                  linestyles=":", label="off + the bare record (FLOOR)" if x == 0 else None)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("thousand instructions per request (router process)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Tracing's instructions in the router (callgrind), FAKE workers\n{stamp(result['machine'])}")
    save(fig, path)


def table(result: dict) -> str:
    rows = [f"| {mode} | {d['per_request_off'] / 1000:.0f}k | {d['ratio_on_over_off']:.2f} "
            f"(+{d['added_by_tracing'] / 1000:.0f}k) | {d['ratio_sampled_over_off']:.2f} | "
            f"{1 + d['floor_share_of_off']:.3f} |" for mode, d in result["derived"]["modes"].items()]
    s = result["settings"]
    return (f"{s['rounds']} rounds of {s['duration_s']} s, concurrency {s['concurrency']}; medians:\n\n"
            "| mode | off: instructions per request | on / off | 1% sampled / off | off + the bare record / off |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="cells per router and mode (default 2)")
    parser.add_argument("--duration", type=int, default=20, help="counted seconds per cell (default 20)")
    parser.add_argument("--concurrency", type=int, default=8, help="wrk connections (default 8)")
    parser.add_argument("--modes", nargs="+", default=["plain", "stream"], choices=["plain", "stream"])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where tracing-instructions.json and .png go")
    args = parser.parse_args(argv)
    valgrind, control = tools()
    loadgen.wrk_path()
    logs = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    print(f"bench: FAKE workers (bench/harness/fake_worker.py); process logs and dumps in {logs}", flush=True)
    measured_on = {**machine.machine(), "wrk": loadgen.wrk_version(), "valgrind": subprocess.run(
        [valgrind, "--version"], capture_output=True, text=True).stdout.strip()}
    floor_per_loop = floor(valgrind)
    print(f"floor (the bare record): {floor_per_loop:.0f} instructions per request", flush=True)
    started: list[procs.Proc] = []
    cells: list[dict] = []
    with Receiver(keep=False, nice=19) as collector:
        try:
            fakes = procs.start_fakes(logs, 16)
            started += fakes
            env = collector.exporter_env()
            routers = {v: start_router(v, logs, valgrind, fakes, {**env, **own}) for v, own in VARIANTS.items()}
            started += routers.values()
            for proc in routers.values():  # valgrind starts Python in tens of seconds
                procs.wait_ready(proc, lambda p=proc: procs.generate_ok(p.port), 600)
                for mode in args.modes:  # warm: every code path taken once before counting
                    loadgen.run(f"http://{procs.HOST}:{proc.port}", "/generate", loadgen.body_for(mode == "stream", 16),
                                mode == "stream", args.concurrency, 5, timeout=60)
            for r in range(args.rounds):
                for mode in args.modes:
                    for name, proc in routers.items():
                        cell = {**count(proc, control, logs, name, mode, args.duration, args.concurrency), "round": r}
                        cells.append(cell)
                        print(f"round {r} {mode:6} {name:8} {cell['requests']:>6} requests "
                              f"{cell['per_request']:>9} instructions each", flush=True)
        finally:
            for proc in reversed(started):
                proc.stop()
    result = {
        "benchmark": "the router's instructions per request (callgrind) with tracing off, on and 1% sampled, on FAKE "
                     "SGLang workers; and the bare record's (FLOOR)",
        "settings": {"rounds": args.rounds, "duration_s": args.duration, "concurrency": args.concurrency,
                     "modes": args.modes, "chunks_per_stream": 16, "router_processes": 1, "target_ratio": TARGET,
                     "floor_code": FLOOR},
        "machine": measured_on, "floor_per_request": round(floor_per_loop), "cells": cells,
        "derived": derive(cells, args.modes, floor_per_loop),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing-instructions.json").write_text(json.dumps(result, indent=2) + "\n")
    draw(result, args.out / "tracing-instructions.png")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
