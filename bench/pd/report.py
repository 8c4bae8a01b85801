"""bench.pd's results: goodput under the ITL SLO, medians and spreads of the repeats, PD/colocated ratios paired
within each repeat, the verdicts against PD's targets, the picture, and the Markdown table bench/README.md shows.

`python -m bench.pd.report [bench/results/pd.json]` derives, draws and prints the table again from a results file.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from bench.harness import plot
from bench.harness.markdown import grid, load, met, num, source

MODES = ("colocated", "pd")
SLO_FACTOR = 3.0  # a stream meets the SLO when its own ITL p99 <= 3x its mode's idle ITL (p50, no long prompts)
KEYS = {"itl_p50": ("itl_ms", "p50"), "itl_p99": ("itl_ms", "p99"), "itl_max": ("itl_ms", "max"),
        "ttft_short_p50": ("ttft_short_ms", "p50"), "ttft_short_p99": ("ttft_short_ms", "p99"),
        "ttft_long_p50": ("ttft_long_ms", "p50"), "ttft_long_p99": ("ttft_long_ms", "p99"),
        "ttft_probe_p50": ("ttft_probe_ms", "p50"), "ttft_probe_p99": ("ttft_probe_ms", "p99"),
        "tokens_per_s": ("output_tokens_per_s", None), "goodput": ("goodput_streams_per_s", None)}
TARGET_PERIOD = 6.0
# cores the rest of the machine used during a cell: above it, the cell was not alone
CONTENDED = 0.3


def _get(cell: dict, key: str) -> float | None:
    outer, inner = KEYS[key]
    value = cell.get(outer)  # a results file from before the probes has no ttft_probe_ms
    return (value or {}).get(inner) if inner else value


def _label(period: float | None) -> str:
    return "none" if not period else f"every {period:g} s"


def derive(cells: list[dict]) -> dict:
    """Adds each cell's goodput (in place) and returns the summary: per mode and rate the repeats, their median and
    spread; per rate the PD/colocated ratio of the medians and its paired min-max; the verdicts."""
    idle_itl, slo = {}, {}
    for mode in MODES:
        base = [c["itl_ms"]["p50"] for c in cells if c["mode"] == mode and not c["period_s"] and c["itl_ms"]["p50"]]
        idle_itl[mode] = statistics.median(base) if base else None
        slo[mode] = SLO_FACTOR * idle_itl[mode] if idle_itl[mode] else None
    for c in cells:
        ok = [v for v in c["stream_itl_p99_ms"] if slo[c["mode"]] and v <= slo[c["mode"]]]
        c["goodput_streams_per_s"] = round(len(ok) / c["window_s"], 4)
    periods = sorted({c["period_s"] for c in cells}, key=lambda p: p or 0)
    summary, ratios = {}, {}
    for period in periods:
        for mode in MODES:
            mine = sorted((c for c in cells if c["mode"] == mode and c["period_s"] == period),
                          key=lambda c: c["repeat"])
            row = {}
            for key in KEYS:
                values = [_get(c, key) for c in mine]
                got = [v for v in values if v is not None]
                med = statistics.median(got) if got else None
                row[key] = {"repeats": values, "median": med,
                            "spread_pct": round(100 * (max(got) - min(got)) / med, 1) if got and med else None}
            summary[f"{mode}/{_label(period)}"] = row
        pairs = {}
        for key in KEYS:
            col, pd = summary[f"colocated/{_label(period)}"][key], summary[f"pd/{_label(period)}"][key]
            paired = [round(p / c, 3) for p, c in zip(pd["repeats"], col["repeats"], strict=False)
                      if p is not None and c]
            pairs[key] = {"ratio": round(pd["median"] / col["median"], 3) if pd["median"] and col["median"] else None,
                          "paired": paired, "min": min(paired, default=None), "max": max(paired, default=None)}
        ratios[_label(period)] = pairs
    verdicts = {}
    at = ratios.get(_label(TARGET_PERIOD))
    if at:
        verdicts["PD ITL p99 <= 0.1x colocated, a long prompt every 6 s"] = _verdict(at["itl_p99"], 0.1, "<=")
        col, pd = (summary[f"{m}/{_label(TARGET_PERIOD)}"]["goodput"]["repeats"] for m in MODES)
        verdicts["PD goodput > colocated's, a long prompt every 6 s"] = {  # a ratio has no meaning over 0
            "pd": pd, "colocated": col, "target": "higher in every repeat",
            "pass": bool(pd) and all(p is not None and c is not None and p > c for p, c in zip(pd, col, strict=False))}
    for label, pairs in ratios.items():
        # The open-loop probes: a short prompt that arrives whenever it comes (the streams' own requests cannot
        # arrive during a colocated stall, bench/pd/load.py's docstring).
        verdicts[f"PD short-prompt TTFT p50 <= 1.5x colocated (open-loop probes), long prompts {label}"] = _verdict(
            pairs["ttft_probe_p50"], 1.5, "<=")
        verdicts[f"(closed loop, for the record) PD streams' request TTFT p50 <= 1.5x colocated, long prompts "
                 f"{label}"] = _verdict(pairs["ttft_short_p50"], 1.5, "<=")
    return {"idle_itl_ms": idle_itl, "slo_itl_p99_ms": slo, "summary": summary, "ratios_pd_over_colocated": ratios,
            "verdicts": verdicts}


def _verdict(pair: dict, limit: float, op: str) -> dict:
    """Met only if every repeat's paired ratio is on the right side."""
    worst = pair["max"] if op == "<=" else pair["min"]
    ok = worst is not None and (worst <= limit if op == "<=" else worst > limit)
    return {"ratio": pair["ratio"], "paired": pair["paired"], "target": f"{op} {limit:g}", "pass": ok}


def _fmt(values: list, digits: int = 0) -> str:
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def table(result: dict) -> str:
    lines = []
    for name, run in result["models"].items():
        d = run["derived"]
        lines += [f"### {name}: idle ITL p50 {d['idle_itl_ms']}, SLO ITL p99 {d['slo_itl_p99_ms']} (ms)", "",
                  ("| long prompts | mode | ITL p50 (ms) | ITL p99 | ITL max | TTFT short p50 | TTFT short p99 | "
                   "TTFT long p50 | TTFT long p99 | TTFT probe p50 | TTFT probe p99 | output tok/s | "
                   "goodput streams/s | CPU cores per tree |"),
                  "|---" * 14 + "|"]
        for key, row in d["summary"].items():
            mode, label = key.split("/")
            cpu = [c["cpu_cores"] for c in run["cells"] if c["mode"] == mode and _label(c["period_s"]) == label]
            busy = {k: round(statistics.median(c[k] for c in cpu), 2) for k in cpu[0] if
                    statistics.median(c[k] for c in cpu) >= 0.05} if cpu else {}
            cols = [_fmt(row[k]["repeats"]) for k in ("itl_p50", "itl_p99", "itl_max", "ttft_short_p50",
                                                       "ttft_short_p99", "ttft_long_p50", "ttft_long_p99",
                                                       "ttft_probe_p50", "ttft_probe_p99")]
            cols += [_fmt(row["tokens_per_s"]["repeats"], 1), _fmt(row["goodput"]["repeats"], 3)]
            lines.append(f"| {label} | {mode} | " + " | ".join(cols) + f" | {busy} |")
        lines += ["", "| long prompts | " + " | ".join(f"PD/colocated {k}" for k in KEYS) + " |",
                  "|---" * (len(KEYS) + 1) + "|"]
        for label, pairs in d["ratios_pd_over_colocated"].items():
            lines.append(f"| {label} | " + " | ".join(
                "-" if p["ratio"] is None else f"{p['ratio']:.2f} ({_fmt([p['min'], p['max']], 2).replace(' / ', '-')})"
                for p in pairs.values()) + " |")
        lines += [""] + [f"- {k}: {'met' if v['pass'] else 'NOT met'} "
                         f"({', '.join(f'{x} {v[x]}' for x in v if x not in ('pass', 'target'))})"
                         for k, v in d["verdicts"].items()]
        lines += [f"- contended (others used > {CONTENDED} cores): " + ", ".join(
            f"{c['mode']} {_label(c['period_s'])} repeat {c['repeat']} ({c['cores_used_by_others']})"
            for c in run["cells"] if c["cores_used_by_others"] > CONTENDED), ""]
    return "\n".join(lines)


def draw(result: dict, path: Path) -> None:
    plt = plot.pyplot()
    names = list(result["models"])
    fig, axes = plt.subplots(len(names), 3, figsize=(15, 4.2 * len(names)), squeeze=False)
    panels = (("ITL p99 of the streams (ms)", ("itl_p99",), True),
              ("TTFT p50 (ms): stream requests o, long x, open-loop probes s",
               ("ttft_short_p50", "ttft_long_p50", "ttft_probe_p50"), True),
              ("goodput: streams/s within the ITL SLO", ("goodput",), False))
    for axrow, name in zip(axes, names, strict=False):
        run = result["models"][name]
        for ax, (title, keys, log) in zip(axrow, panels, strict=False):
            for mode, color in zip(MODES, ("tab:red", "tab:blue"), strict=False):
                for key, marker in zip(keys, "oxs", strict=False):
                    cells = [c for c in run["cells"] if c["mode"] == mode]
                    xs = sorted({60 / c["period_s"] if c["period_s"] else 0 for c in cells})
                    meds = [run["derived"]["summary"][f"{mode}/{_label(60 / x if x else None)}"][key]["median"]
                            for x in xs]
                    ax.plot(xs, meds, color=color, marker=marker, label=f"{mode} {key}")
                    ax.scatter([60 / c["period_s"] if c["period_s"] else 0 for c in cells],
                               [_get(c, key) for c in cells], color=color, alpha=0.35, s=14)
            ax.set_title(f"{name}: {title}", fontsize=9)
            ax.set_xlabel("long prompts per minute")
            if log:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
    prefill_args = result["settings"].get("prefill_args") or "SGLang's default scheduling"
    colocated_args = result["settings"].get("colocated_args") or "SGLang's default scheduling"
    fig.suptitle(f"PD (1 prefill on core 0: {prefill_args}; 1 decode on core 1) vs one colocated SGLang server "
                 f"({colocated_args}),\n4 streams of 96 tokens; lines: medians, dots: each repeat "
                 f"({plot.stamp(result['machine'])})", fontsize=9)
    plot.save(fig, path)


def rederive(path: Path) -> dict:
    """Derive, draw and tabulate again from a results file's cells (after a change here, without a re-run)."""
    result = json.loads(path.read_text())
    for run in result["models"].values():
        run["derived"] = derive(run["cells"])
    path.write_text(json.dumps(result, indent=1) + "\n")
    draw(result, path.with_suffix(".png"))
    return result


if __name__ == "__main__":
    print(table(rederive(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/pd.json"))))


PD_COLUMNS = (("itl_p50", "ITL p50 ms", 0), ("itl_p99", "ITL p99 ms", 0), ("ttft_probe_p50", "probe TTFT p50 ms", 0),
              ("ttft_long_p50", "long TTFT p50 ms", 0), ("tokens_per_s", "output tok/s", 1),
              ("goodput", "goodput streams/s", 2))


def readme_table(name: str, cells: bool = True) -> str:
    """bench/README.md's table of a run: per rate of long prompts each mode's numbers (`cells`) and PD over
    colocated."""
    result = load(name)
    parts = []
    for model, run in result["models"].items():
        d = run["derived"]
        rows = []
        for key, row in d["summary"].items():
            mode, label = key.split("/")
            rows.append([label, mode, *(_fmt(row[k]["repeats"], digits) for k, _, digits in PD_COLUMNS)])
        ratios = [[label, *(_paired_ratio(pairs[k]) for k, _, _ in PD_COLUMNS)]
                  for label, pairs in d["ratios_pd_over_colocated"].items()]
        idle = ", ".join(f"{m} {v:.0f} ms" for m, v in d["idle_itl_ms"].items())
        table = grid(["long prompts", "mode", *(h for _, h, _ in PD_COLUMNS)], rows) + "\n\n" if cells else ""
        parts.append(f"{source(result, name)} {model}, repeat 0 / repeat 1; idle ITL p50 {idle}\n\n" + table
                     + grid(["long prompts", *(f"PD / colocated {h.removesuffix(' ms')}" for _, h, _ in PD_COLUMNS)],
                            ratios))
    return "\n\n".join(parts)


def _paired_ratio(pair: dict) -> str:
    if pair["ratio"] is None:
        return "-"
    return f"{pair['ratio']:.2f} ({num(pair['min'])}-{num(pair['max'])})"


def readme_verdicts(name: str = "pd.json") -> str:
    result = load(name)
    rows = []
    for run in result["models"].values():
        for goal, v in run["derived"]["verdicts"].items():
            if goal.startswith("(closed loop"):  # for the record only: the probes are what a short prompt is judged by
                continue
            got = v.get("ratio", f"PD {v.get('pd')} vs colocated {v.get('colocated')}")
            rows.append([goal, "-" if got is None else got, ", ".join(map(str, v.get("paired", []))) or "-",
                         met(v["pass"])])
    return grid(["target", "PD / colocated", "per repeat", "verdict"], rows)
