"""bench.cluster's numbers: medians over repeats with their spread, the ratios the issue asks for, and for each ratio
whether the repeats' ranges overlap (then the noise is at least as big as the difference)."""

from __future__ import annotations

import statistics

from bench.serving import METRICS

EXTRA = ("cached_tokens", "cache_hit_rate_pct", "errors", "cores_used_by_others")
# (name, (session, target, workload) of the numerator, same of the denominator)
COMPARISONS = (
    ("ours / SGLang router (random)", ("main", "ours", "random"), ("main", "sglang", "random")),
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
                                "spread_pct": round(100 * (max(values) - min(values)) / median, 1) if median else None}
        summary[key] = cell
    return summary


def derive(summary: dict, idle_cpu: dict) -> dict:
    ratios = {}
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
    idle = {}
    for variant, cores in idle_cpu.items():
        idle[variant] = {"cores": cores["local_yaml_shape_total"], "target": f"< {IDLE_TARGET_CORES}",
                         "pass": cores["local_yaml_shape_total"] < IDLE_TARGET_CORES,
                         "others_meanwhile": cores["others"]}
    return {"ratios": ratios, "idle_local_cluster": idle}


def lines(derived: dict) -> list[str]:
    out = []
    for name, metrics in derived["ratios"].items():
        parts = [f"{m} {v['ratio']:.2f}x{' (noise)' if v['within_noise'] else ''}" for m, v in metrics.items()
                 if m in ("request_throughput", "median_ttft_ms", "median_tpot_ms", "request_goodput",
                          "cached_tokens")]
        out.append(f"{name}: " + ", ".join(parts))
    for variant, v in derived["idle_local_cluster"].items():
        out.append(f"idle local cluster, {variant}: {v['cores']:.3f} cores ({'PASS' if v['pass'] else 'FAIL'} "
                   f"{v['target']}; others used {v['others_meanwhile']:.2f} cores meanwhile)")
    return out
