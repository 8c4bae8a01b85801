"""tests.chaos: the run's summary, its JSON (compact rows) and its picture."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from bench.harness.plot import pyplot, save
from tests.chaos.cluster import DEADLINE, SIZES
from tests.chaos.load import Record


def summarize(records: list[Record]) -> dict:
    out: dict = {"requests": len(records)}
    for outcome in ("ok", "error", "refused", "defect"):
        out[outcome] = sum(1 for r in records if r.outcome == outcome)
    kinds: dict[str, dict] = {}
    for r in records:
        key = f"{r.route} {'stream' if r.stream else 'plain'}"
        kinds.setdefault(key, {"ok": 0, "error": 0, "refused": 0, "defect": 0})[r.outcome] += 1
    out["by_kind"] = kinds
    out["by_size"] = {s: sum(1 for r in records if r.size == s and r.outcome == "ok") for s in SIZES}
    latencies = [r.ended - r.started for r in records if r.outcome == "ok"]
    if latencies:
        latencies.sort()
        out["ok_latency_s"] = {"p50": round(statistics.median(latencies), 2),
                               "p99": round(latencies[int(0.99 * (len(latencies) - 1))], 2),
                               "max": round(latencies[-1], 2)}
    return out


def dump(result: dict) -> str:
    """Indented JSON, with every list or object of plain values on one line (the per-request rows, the timeline):
    a tenth of the lines, and a diff still shows what changed."""
    text = json.dumps(result, indent=1)
    for pattern in (r"\[\n\s+([^\[\]{}]*?)\n\s+\]", r"\{\n\s+([^\[\]{}]*?)\n\s+\}"):
        opening, closing = pattern[1], pattern[-1]
        text = re.sub(pattern, lambda m, opening=opening, closing=closing:
                      opening + " ".join(line.strip() for line in m.group(1).splitlines()) + closing, text)
    return text + "\n"


def timeline(records: list[Record]) -> list[dict]:
    """Per second of the run: answers, clear errors, refusals and defects, by the second each request ended."""
    if not records:
        return []
    seconds = int(max(r.ended for r in records)) + 1
    rows = [{"t": t, "ok": 0, "error": 0, "refused": 0, "defect": 0} for t in range(seconds)]
    for r in records:
        rows[int(r.ended)][r.outcome] += 1
    return rows


def draw(result: dict, path: Path) -> None:
    rows = result["timeline"]
    if not rows:
        return
    window = 5  # seconds: a moving mean keeps the low rates readable

    def rate(key: str) -> list[float]:
        values = [r[key] for r in rows]
        return [sum(values[max(0, i - window + 1):i + 1]) / min(window, i + 1) for i in range(len(values))]

    t = [r["t"] for r in rows]
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(15, 9), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    top.plot(t, rate("ok"), color="#2ca02c", label="right answers/s")
    top.plot(t, rate("error"), color="#d62728", label="clear errors/s (JSON 4xx/5xx, SSE error event)")
    refused = top.twinx()
    refused.plot(t, rate("refused"), color="#7f7f7f", lw=1, label="refused/s, right axis (router restarting)")
    refused.set_ylabel("refused/s", color="#7f7f7f")
    defects = [r["t"] for r in rows if r["defect"]]
    if defects:
        top.scatter(defects, [0] * len(defects), color="black", marker="x", s=60, zorder=5, label="defects")
    colors = {"hang": "#9467bd", "stall": "#8c564b", "kill": "#d62728", "restart": "#ff7f0e", "network": "#17becf"}
    for fault in result["faults"]:
        start, color = fault["injected_at"], colors.get(fault["kind"], "#cccccc")
        end = fault["recovered_at"] or (fault["resumed_at"] or start) + 5
        for ax in (top, bottom):
            ax.axvspan(start, end, color=color, alpha=0.12)
            if fault["resumed_at"]:
                ax.axvline(fault["resumed_at"], color=color, alpha=0.6, lw=1, ls="--")
            if fault["detected_s"] is not None:
                ax.axvline(start + fault["detected_s"], color=color, alpha=0.9, lw=1, ls=":")
        detected = "not seen" if fault["detected_s"] is None else f"out in {fault['detected_s']:.1f}s"
        top.annotate(f"{fault['name']}: {detected}, serving again after {fault['recovered_s']}s"
                     f"{'' if fault['ok'] else ' (FAILED)'}", (start, 0.98), xycoords=("data", "axes fraction"),
                     va="top", ha="right", fontsize=7, rotation=90)
    top.set_ylabel(f"per second ({window} s moving mean)")
    lines = top.get_legend_handles_labels()[0] + refused.get_legend_handles_labels()[0]
    top.legend(lines, [h.get_label() for h in lines], loc="lower left", fontsize=8, framealpha=0.85)
    top.grid(alpha=0.3)
    s = result["summary"]
    top.set_title(f"Chaos run: {s.get('requests', 0)} requests, {s.get('ok', 0)} right, {s.get('error', 0)} clear "
                  f"errors, {s.get('refused', 0)} refused, {s.get('defect', 0)} defects "
                  f"({'passed' if result['passed'] else 'FAILED'})")
    style = {"ok": ("#2ca02c", "o", "right answer"), "error": ("#d62728", "s", "clear error"),
             "refused": ("#7f7f7f", ".", "refused"), "defect": ("black", "x", "defect")}
    columns = result["requests_columns"]
    requests = [dict(zip(columns, row, strict=True)) for row in result["requests"]]
    for outcome, (color, marker, label) in style.items():
        mine = [r for r in requests if r["outcome"] == outcome]
        if mine:
            bottom.scatter([r["started"] for r in mine], [max(0.01, r["ended"] - r["started"]) for r in mine],
                           s=8 if outcome == "ok" else 24, color=color, marker=marker, alpha=0.6, label=label)
    bottom.axhline(DEADLINE, color="black", lw=1, ls="--", alpha=0.5)
    bottom.set_yscale("log")
    bottom.set_ylabel("request duration, s (log; dashed: the deadline)")
    bottom.set_xlabel("seconds since the load started, by the request's start (shaded: a fault from injection until "
                      "every worker serves again; dotted: out of rotation; dashed: SIGCONT / network back)")
    bottom.legend(loc="upper left", fontsize=8)
    bottom.grid(alpha=0.3, which="both")
    save(fig, path)
