"""The load generator: wrk (C, epoll, keep-alive) driven by bench/wrk_post.lua.

wrk keeps `concurrency` connections each with exactly one request in flight (a closed loop), for a fixed time, and
reports per-request latency percentiles (first byte sent to last byte received). The Lua script checks every
answer (status 200; a JSON body with "text", or an SSE stream ending in `data: [DONE]`) and counts SSE chunks.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from pathlib import Path

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
