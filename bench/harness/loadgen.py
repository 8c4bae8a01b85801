"""The load generator: wrk (C, epoll, keep-alive) driven by bench/harness/wrk_post.lua, and a measured cell of it
against routers on the fake workers (bench.router, bench.tracing.cost): the load, and the CPU every process under
test used meanwhile.

wrk keeps `concurrency` connections each with exactly one request in flight (a closed loop), for a fixed time, and
reports per-request latency percentiles (first byte sent to last byte received). The Lua script checks every
answer (status 200; a JSON body with "text", or an SSE stream ending in `data: [DONE]`) and counts SSE chunks.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import cpu, procs
from bench.harness.machine import machine

LUA = Path(__file__).resolve().parent / "wrk_post.lua"


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("bench: wrk is not installed (Debian: apt-get install wrk, or `make system-packages`)")
    return path


def wrk_version() -> str:
    out = subprocess.run([wrk_path(), "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).splitlines()[0].strip()


def body_for(stream: bool, tokens: int) -> str:
    return json.dumps({"text": "The capital of France is", "stream": stream,
                       "sampling_params": {"max_new_tokens": tokens, "temperature": 0}})


def run(url: str, path: str, body: str, stream: bool, concurrency: int, duration: float,
        threads: int = 1, timeout: float = 10.0) -> dict:
    """One wrk run; returns its raw numbers plus the CPU seconds wrk itself used."""
    argv = [wrk_path(), f"-t{min(threads, concurrency)}", f"-c{concurrency}", f"-d{max(duration, 1):.0f}s",
            "--timeout", f"{timeout:.0f}s", "-s", str(LUA), f"{url}{path}", "--", path, body, "1" if stream else "0"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + timeout + 30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    result = json.loads(line[len("WRK_JSON "):])
    result["cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def summarize(raw: dict, stream: bool) -> dict:
    """The numbers a report cell keeps: counts, errors, latency in ms, requests/s and chunks/s."""
    seconds, answered = raw["duration_us"] / 1e6, raw["requests"] > 0
    pct = raw["latency_us"]["percentiles"]
    errors = {k: v for k, v in raw["errors"].items() if k != "status"}  # status >= 400 is counted in "bad" too
    errors["bad_answer"] = raw["bad"]
    return {
        "duration_s": round(seconds, 3),
        "requests": raw["requests"],
        "errors": errors,
        "errors_total": sum(errors.values()),
        # None when nothing was answered within the cell (a stalled target), never a misleading 0.
        "latency_ms": {"p50": pct["50"] / 1e3, "p90": pct["90"] / 1e3, "p99": pct["99"] / 1e3,
                       "p99.9": pct["99.9"] / 1e3, "mean": round(raw["latency_us"]["mean"] / 1e3, 4),
                       "max": raw["latency_us"]["max"] / 1e3} if answered else dict.fromkeys(
                           ("p50", "p90", "p99", "p99.9", "mean", "max")),
        "stalled": not answered,
        "req_per_s": round(raw["requests"] / seconds, 1),
        "chunks_per_s": round(raw["chunks"] / seconds, 1) if stream else None,
        "chunks_per_request": round(raw["chunks"] / raw["requests"], 2) if stream and raw["requests"] else None,
    }


def cell_options(parser: argparse.ArgumentParser) -> None:
    """The options of a run of wrk cells on the fake workers, beside its own (--duration, --concurrency, --out)."""
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured seconds before each cell (default 1)")
    parser.add_argument("--modes", nargs="+", default=["plain", "stream"], choices=["plain", "stream"])
    parser.add_argument("--chunks", type=int, default=16, help="SSE chunks per streamed answer (default 16)")
    parser.add_argument("--quiet-wait", type=float, default=30,
                        help="wait up to this many seconds for other work on the machine to stop (default 30)")


def prepare(args: argparse.Namespace, prefix: str) -> tuple[Path, dict]:
    """Before the first cell: wrk is there and the machine quiet (or waited for up to --quiet-wait); a folder for the
    processes' logs; the machine the run is measured on, with wrk's version and the cores others kept busy."""
    wrk_path()
    busy_before = cpu.wait_for_quiet(args.quiet_wait)
    logs = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"bench: FAKE workers (bench/harness/fake_worker.py); process logs in {logs}", flush=True)
    return logs, {**machine(), "wrk": wrk_version(), "cores_busy_before_start": busy_before}


def print_verdicts(verdicts: dict[str, dict]) -> None:
    """A run's verdicts, one line each: PASS or FAIL, the value, and the target where the verdict names it."""
    for name, v in verdicts.items():
        target = f" (target {v['target']})" if "target" in v else ""
        print(f"  {'PASS' if v['pass'] else 'FAIL'}  {name}: {v['value']}{target}")


def sanity_check(target: str, port: int, chunks: int) -> None:
    """One plain and one streamed request, checked in full, before any load."""
    status, body = procs.request(port, "POST", "/generate", body_for(False, chunks).encode())
    answer = json.loads(body) if status == 200 else {}
    if not {"text", "output_ids", "meta_info"} <= set(answer):
        raise RuntimeError(f"{target}: plain /generate answered {status} {body[:200]!r}")
    status, body = procs.request(port, "POST", "/generate", body_for(True, chunks).encode())
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    if status != 200 or len(events) != chunks + 1 or events[-1] != "data: [DONE]":
        raise RuntimeError(f"{target}: streamed /generate answered {status}, {len(events)} events: {body[:200]!r}")


def measure(name: str, port: int, conc: int, mode: str, args: argparse.Namespace, watched: dict) -> dict:
    """One cell: wrk on `name` (at `port`) for args.duration after args.warmup, and the cores each of `watched` (the
    fakes as fake_prefill and fake_decode, the routers as router_<name>: anything with `cpu_seconds()`), wrk and the
    rest of the machine used meanwhile."""
    stream = mode == "stream"
    body, url = body_for(stream, args.chunks), f"http://{procs.HOST}:{port}"
    if args.warmup:
        run(url, "/generate", body, stream, conc, args.warmup)
    settled = cpu.settle(watched)
    before_cpu = {k: p.cpu_seconds() for k, p in watched.items()}
    before_up = {k: procs.fake_generate_count(watched[k]) for k in ("fake_prefill", "fake_decode")}
    before_busy, started = cpu.busy_cpu_seconds(), time.monotonic()
    raw = run(url, "/generate", body, stream, conc, args.duration)
    wall = time.monotonic() - started
    busy = cpu.busy_cpu_seconds() - before_busy
    cell = {"target": name, "concurrency": conc, "mode": mode, **summarize(raw, stream)}
    cores = {k: round((p.cpu_seconds() - before_cpu[k]) / wall, 3) for k, p in watched.items()}
    cores["wrk"] = round(raw["cpu_seconds"] / wall, 3)
    cores["machine_total"] = round(busy / wall, 3)
    cores["everything_else"] = round(max(0.0, cores["machine_total"] - sum(
        v for k, v in cores.items() if k not in ("machine_total",))), 3)
    cell["cpu_cores"] = cores
    own = cores.get(f"router_{name}", cores["fake_decode"] if name == "direct" else None)
    # CPU the target itself spent per request: steadier than wall-clock numbers when the machine is shared.
    cell["target_cpu_ms_per_request"] = round(1000 * own * wall / max(cell["requests"], 1), 3) if own else None
    cell["contended"] = cores["everything_else"] > cpu.CONTENDED_CORES
    # /generate calls the fakes got during the measured window: both halves of every routed request.
    cell["upstream_generate_calls"] = {k: procs.fake_generate_count(watched[k]) - before_up[k] for k in before_up}
    cell["settle_s"] = {"after_warmup": settled, "after": cpu.settle(watched)}
    return cell
