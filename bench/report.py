"""Turn the measured cells into verdicts against the router's targets; describe the machine they were measured on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata

import psutil

TARGETS = ("direct", "ours", "sglang")
ROUTERS = ("ours", "sglang")
LATENCY_CONCURRENCY = (1, 32)  # where the added-latency targets apply
ADDED_P50_MAX_MS, ADDED_P99_MAX_MS = 1.0, 5.0
HEADROOM_MIN = 2.0  # direct throughput over each router's
PACKAGES = ("sglang", "sglang-router", "fastapi", "starlette", "uvicorn", "httpx", "httpcore", "h11", "anyio",
            "httptools", "uvloop", "aiohttp", "orjson", "httpx2", "matplotlib", "psutil")


def _cell(cells: list[dict], target: str, concurrency: int, mode: str) -> dict | None:
    return next((c for c in cells if (c["target"], c["concurrency"], c["mode"]) == (target, concurrency, mode)), None)


def _diff(a: float | None, b: float | None) -> float | None:
    return round(a - b, 3) if a is not None and b is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def derive(cells: list[dict]) -> dict:
    """Added latency over direct, peak throughputs, the throughput ratio at the top concurrency, and verdicts."""
    concurrencies = sorted({c["concurrency"] for c in cells})
    modes = [m for m in ("plain", "stream") if any(c["mode"] == m for c in cells)]
    added = {}
    for router in ROUTERS:
        for conc in concurrencies:
            for mode in modes:
                mine, direct = _cell(cells, router, conc, mode), _cell(cells, "direct", conc, mode)
                if mine and direct:
                    added[f"{router}/c{conc}/{mode}"] = {
                        q: _diff(mine["latency_ms"][q], direct["latency_ms"][q]) for q in ("p50", "p99")}
    peak = {}
    for target in TARGETS:
        rows = [c for c in cells if c["target"] == target]
        if rows:
            peak[target] = {
                "max_req_per_s_plain": max((c["req_per_s"] for c in rows if c["mode"] == "plain"), default=None),
                "max_req_per_s_stream": max((c["req_per_s"] for c in rows if c["mode"] == "stream"), default=None),
                "max_chunks_per_s": max((c["chunks_per_s"] or 0 for c in rows if c["mode"] == "stream"), default=None),
            }
    top = max(concurrencies)
    at_top = {}
    for mode, key in (("plain", "req_per_s"), ("stream", "chunks_per_s")):
        ours, sglang = _cell(cells, "ours", top, mode), _cell(cells, "sglang", top, mode)
        if ours and sglang:
            at_top[f"ours_over_sglang_{key}_c{top}"] = _ratio(ours[key], sglang[key])
    headroom = {}
    for router in ROUTERS:
        for key in ("max_req_per_s_plain", "max_chunks_per_s"):
            if router in peak and "direct" in peak:
                headroom[f"direct_over_{router}_{key}"] = _ratio(peak["direct"][key], peak[router][key])
    verdicts = {}
    for name, value in added.items():
        router, conc, mode = name.split("/")
        if router == "ours" and int(conc[1:]) in LATENCY_CONCURRENCY:
            verdicts[f"added_p50_ms {name}"] = _verdict(value["p50"], "<=", ADDED_P50_MAX_MS)
            verdicts[f"added_p99_ms {name}"] = _verdict(value["p99"], "<=", ADDED_P99_MAX_MS)
    for name, value in at_top.items():
        verdicts[name] = _verdict(value, ">=", 1.0)
    for name, value in headroom.items():
        verdicts[f"fakes not the bottleneck: {name}"] = _verdict(value, ">=", HEADROOM_MIN)
    bad = sum(1 for c in cells if c["errors_total"] or c["stalled"])
    verdicts["cells with errors or no answer at all"] = _verdict(bad, "<=", 0)
    contended = [f"{c['target']}/c{c['concurrency']}/{c['mode']}" for c in cells if c.get("contended")]
    return {"added_latency_ms": added, "peak": peak, "ratios_at_top_concurrency": at_top,
            "direct_headroom": headroom, "contended_cells": contended, "verdicts": verdicts,
            "all_targets_met": all(v["pass"] for v in verdicts.values())}


def _verdict(value: float | None, op: str, limit: float) -> dict:
    ok = value is not None and (value <= limit if op == "<=" else value >= limit)
    return {"value": value, "target": f"{op} {limit:g}", "pass": ok}


def git(*args: str) -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((ln.split(":", 1)[1].strip() for ln in handle if ln.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # The router measured is the working tree's: its commit, and whether router/ had uncommitted changes.
        "git_commit": git("rev-parse", "HEAD"), "router_uncommitted_changes": bool(git("status", "--porcelain",
                                                                                        "router/")),
        "platform": platform.platform(), "cpu_model": model, "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0], "versions": versions,
        # uvicorn's "auto" HTTP parser is httptools when installed, else the pure-Python h11.
        "uvicorn_auto_http_impl": "httptools" if versions["httptools"] else "h11",
    }
