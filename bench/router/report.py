"""The router benchmark's cells turned into verdicts against the router's targets, and bench/README.md's table of
them."""

from __future__ import annotations

from bench.harness.markdown import grid, load, num, source

TARGETS = ("direct", "ours", "sglang")
ROUTERS = ("ours", "sglang")
LATENCY_CONCURRENCY = (1, 32)  # where the added-latency targets apply
ADDED_P50_MAX_MS, ADDED_P99_MAX_MS = 1.0, 5.0
HEADROOM_MIN = 2.0  # direct throughput over each router's
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


def readme_table(name: str = "router.json") -> str:
    """bench/README.md's table: each router's added latency, throughput and CPU per request against the other's."""
    result = load(name)
    cells = {(c["target"], c["concurrency"], c["mode"]): c for c in result["cells"]}
    added = result["derived"]["added_latency_ms"]
    rows = []
    for conc in result["settings"]["concurrency"]:
        for mode in result["settings"]["modes"]:
            ours, sgl = cells[("ours", conc, mode)], cells[("sglang", conc, mode)]
            a, b = added[f"ours/c{conc}/{mode}"], added[f"sglang/c{conc}/{mode}"]
            rate = "chunks_per_s" if mode == "stream" else "req_per_s"
            rows.append([conc, mode, f"{num(a['p50'])} / {num(a['p99'])}", f"{num(b['p50'])} / {num(b['p99'])}",
                         f"{ours[rate]:.0f} / {sgl[rate]:.0f} ({ours[rate] / sgl[rate]:.2f}x)",
                         f"{num(ours['target_cpu_ms_per_request'], 3)} / {num(sgl['target_cpu_ms_per_request'], 3)}"])
    return source(result, name) + "\n\n" + grid(
        ["concurrency", "mode", "added p50 / p99 ms, ours", "added p50 / p99 ms, SGLang's",
         "ours / SGLang's req/s (plain) or chunks/s (stream)", "CPU ms per request, ours / SGLang's"], rows)
