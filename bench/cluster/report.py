"""bench.cluster's numbers: medians over repeats with their spread, the ratios of COMPARISONS, and for each ratio
whether the repeats' ranges overlap (then the noise is at least as big as the difference).

Paired ratios: the two targets of a comparison run next to each other in every repeat, so the ratio within one
repeat sees through a drift of the machine's speed between repeats, which moves both; if every repeat's ratio
lies on the same side of 1, the direction of the difference held in every repeat."""

from __future__ import annotations

import statistics

from bench.harness.markdown import grid, load, source
from bench.harness.serving import METRICS

EXTRA = ("cached_tokens", "cache_hit_rate_pct", "errors", "cores_used_by_others", "machine_probe_ms")
# (name, (session, target, workload) of the numerator, same of the denominator)
COMPARISONS = (
    ("ours / SGLang router (random)", ("main", "ours", "random"), ("main", "sglang", "random")),
    ("ours / ours twin (random, A/A: the noise)", ("main", "ours", "random"), ("main", "ours-twin", "random")),
    ("PD / colocated (random)", ("main", "ours", "random"), ("main", "colocated", "random")),
    ("PD / colocated (one at a time)", ("main", "ours", "serial"), ("main", "colocated", "serial")),
    ("prefix / round_robin (shared prefix)", ("main", "prefix", "shared-prefix"),
     ("main", "round_robin", "shared-prefix")),
    ("sleep-on-idle on / off (random)", ("main", "ours", "random"), ("busy-poll", "ours", "random")),
    ("sleep-on-idle on / off (one at a time)", ("main", "ours", "serial"), ("busy-poll", "ours", "serial")),
)
RATIO_METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                 "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "request_goodput", "cached_tokens")
IDLE_TARGET_CORES = 0.10


def summarize(runs: list[dict]) -> dict:
    """{"session/target/workload": {metric: {"median", "min", "max", "spread_pct", "runs"}}}"""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(f"{run['session']}/{run['target']}/{run['workload']}", []).append(run)
    summary = {}
    for key, rows in groups.items():
        cell = {}
        for metric in (*METRICS, *EXTRA):
            values = [r[metric] for r in rows if r.get(metric) is not None]
            if values:
                median = statistics.median(values)
                cell[metric] = {"median": round(median, 3), "min": round(min(values), 3),
                                "max": round(max(values), 3), "runs": [round(v, 3) for v in values],
                                "spread_pct": spread_pct(values)}
        summary[key] = cell
    return summary


def spread_pct(values: list[float]) -> float | None:
    """(max - min) / median, in percent: how far apart the repeats (or the per-repeat ratios) lie."""
    median = statistics.median(values)
    return round(100 * (max(values) - min(values)) / median, 1) if median else None


def paired(runs: list[dict], top: tuple, bottom: tuple, metric: str) -> list[float]:
    """The ratio top/bottom within each repeat that ran both; top and bottom are (session, target, workload)."""
    def by_repeat(key: tuple) -> dict[int, float]:
        return {r["repeat"]: r[metric] for r in runs
                if (r["session"], r["target"], r["workload"]) == key and r.get(metric) is not None}
    a, b = by_repeat(top), by_repeat(bottom)
    return [round(a[k] / b[k], 3) for k in sorted(a) if b.get(k)]


def derive(summary: dict, idle_cpu: dict, runs: list[dict] = ()) -> dict:
    runs, ratios = list(runs), {}
    for name, top, bottom in COMPARISONS:
        a, b = summary.get("/".join(top)), summary.get("/".join(bottom))
        if not a or not b:
            continue
        ratios[name] = {}
        for metric in RATIO_METRICS:
            if metric in a and metric in b and b[metric]["median"]:
                x, y = a[metric], b[metric]
                overlap = x["min"] <= y["max"] and y["min"] <= x["max"]
                ratios[name][metric] = {"ratio": round(x["median"] / y["median"], 3),
                                        "within_noise": overlap}
                per_repeat = paired(runs, top, bottom, metric)
                if per_repeat:
                    ratios[name][metric]["paired"] = per_repeat
                    ratios[name][metric]["paired_spread_pct"] = spread_pct(per_repeat)
                    ratios[name][metric]["same_side_every_repeat"] = (all(r > 1 for r in per_repeat)
                                                                      or all(r < 1 for r in per_repeat))
    idle = {}
    for variant, cores in idle_cpu.items():
        idle[variant] = {"cores": cores["local_yaml_shape_total"], "target": f"< {IDLE_TARGET_CORES}",
                         "pass": cores["local_yaml_shape_total"] < IDLE_TARGET_CORES,
                         "others_meanwhile": cores["others"]}
    return {"ratios": ratios, "idle_local_cluster": idle, "machine_speed": machine_speed(runs)}


def machine_speed(runs: list[dict]) -> dict:
    """Per session, the spread of the fixed CPU task timed before each run (in the busy-poll session it competes
    with the busy-polling schedulers, so only the main session's shows the machine alone)."""
    speed = {}
    for session in dict.fromkeys(r["session"] for r in runs):
        probes = [r["machine_probe_ms"] for r in runs if r["session"] == session and r.get("machine_probe_ms")]
        if probes:
            speed[session] = {"probe_ms_median": round(statistics.median(probes), 1), "min": min(probes),
                              "max": max(probes), "spread_pct": spread_pct(probes)}
    return speed


def lines(derived: dict) -> list[str]:
    out = []
    for name, metrics in derived["ratios"].items():
        parts = [f"{m} {v['ratio']:.2f}x{' (noise)' if v['within_noise'] else ''}" for m, v in metrics.items()
                 if m in ("request_throughput", "median_ttft_ms", "median_tpot_ms", "request_goodput",
                          "cached_tokens")]
        out.append(f"{name}: " + ", ".join(parts))
        if "paired" in metrics.get("request_throughput", {}):
            paired_runs = metrics["request_throughput"]["paired"]
            out.append(f"  request_throughput within each repeat: {', '.join(f'{r:.3f}x' for r in paired_runs)} "
                       f"(spread {metrics['request_throughput']['paired_spread_pct']:.1f}%)")
    for variant, v in derived["idle_local_cluster"].items():
        out.append(f"idle local cluster, {variant}: {v['cores']:.3f} cores ({'PASS' if v['pass'] else 'FAIL'} "
                   f"{v['target']}; others used {v['others_meanwhile']:.2f} cores meanwhile)")
    for session, m in derived.get("machine_speed", {}).items():
        out.append(f"machine speed in session {session} (a fixed CPU task before each run): {m['min']:.0f}-"
                   f"{m['max']:.0f} ms, spread {m['spread_pct']:.0f}%")
    return out


README_RATIOS = (("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50"), ("median_tpot_ms", "TPOT p50"),
                 ("request_goodput", "goodput"), ("cached_tokens", "cached tokens"))


def readme_ratios(name: str) -> str:
    """bench/README.md's table of a run: each comparison's median ratio, noise and paired ratios; the idle cores."""
    result = load(name)
    rows = []
    for comparison, metrics in result["derived"]["ratios"].items():
        cells = []
        for metric, _ in README_RATIOS:
            v = metrics.get(metric)
            if not v:
                cells.append("-")
                continue
            paired = f" ({', '.join(f'{x:.2f}' for x in v['paired'])})" if v.get("paired") else ""
            cells.append(f"{v['ratio']:.2f}{' noise' if v['within_noise'] else ''}{paired}")
        rows.append([comparison, *cells])
    idle = "; ".join(f"{variant}: {v['cores']:.3f} cores" for variant, v in result["derived"]
                     ["idle_local_cluster"].items())
    return (source(result, name) + " median ratio, `noise` when the repeats' ranges overlap, in brackets the ratio "
            "within each repeat\n\n" + grid(["comparison", *(h for _, h in README_RATIOS)], rows)
            + f"\n\nIdle, the `make up` shape: {idle}.")




def readme_idle(name: str = "idle.json") -> str:
    """bench/README.md's tables of an `--idle-only` run: cores per process tree and per thread kind."""
    result = load(name)
    cpu = result["idle_cpu_cores"]
    rows = [[tree, f"{cores:.4f}"] for tree, cores in cpu["per_tree"].items()]
    rows.append(["**total** (`make up`)", f"**{cpu['local_yaml_shape_total']:.4f}**"])
    if "with_planner_total" in cpu:
        rows.append(["**total** (`make up PLANNER=1`)", f"**{cpu['with_planner_total']:.4f}**"])
    kinds = [[kind, f"{cores:.4f}"] for kind, cores in list(cpu["per_thread_kind"].items())[:2]]  # the busiest
    return (source(result, name) + f" {cpu['seconds']:.0f} s idle\n\n" + grid(["process tree", "cores"], rows)
            + "\n\n" + grid(["process, thread kind x count", "cores"], kinds))
