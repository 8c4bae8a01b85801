"""The store benchmark's numbers: per cell (round, workload, concurrency, mode) the client-measured latency
percentiles; per workload and concurrency, each store's added p50 over `store: false` within each round (paired, so
that a round the machine was slower in weighs on both) and its spread over rounds, against TARGET_MS; the README's
table (bench/tables.py) and the picture."""

from __future__ import annotations

from pathlib import Path

from bench.harness.markdown import grid, met, num
from bench.harness.plot import pyplot, save, stamp
from bench.harness.stats import percentile, spread

TARGET_MS = 2.0  # the store may add at most this much to a turn's p50
MODES = ("off", "sqlite", "postgresql")  # off: `store: false`
STORES = MODES[1:]
LABELS = {"off": "store: false", "sqlite": "store: true, SQLite", "postgresql": "store: true, PostgreSQL"}


def latency(samples_ms: list[float]) -> dict[str, float | None]:
    """A cell's latency percentiles in ms (None when nothing was answered: never a misleading 0)."""
    if not samples_ms:
        return dict.fromkeys(("p50", "p90", "p99", "mean"))
    return {"p50": round(percentile(samples_ms, 50), 3), "p90": round(percentile(samples_ms, 90), 3),
            "p99": round(percentile(samples_ms, 99), 3), "mean": round(sum(samples_ms) / len(samples_ms), 3)}


def derive(cells: list[dict]) -> dict:
    """Per "<workload>, c<concurrency>": each mode's p50 and p99 (median over rounds), and each store's added p50 over
    `store: false` per round, its spread, and whether its median meets TARGET_MS."""
    out: dict = {}
    verdicts: dict = {}
    for workload, concurrency in sorted({(c["workload"], c["concurrency"]) for c in cells},
                                        key=lambda k: (k[1], k[0] != "plain")):
        mine = [c for c in cells if (c["workload"], c["concurrency"]) == (workload, concurrency)]
        rounds = sorted({c["round"] for c in mine if c["mode"] == "off" and c["latency_ms"]["p50"] is not None})
        p50 = {m: {c["round"]: c["latency_ms"]["p50"] for c in mine if c["mode"] == m} for m in MODES}
        key = f"{workload}, c{concurrency}"
        out[key] = {"workload": workload, "concurrency": concurrency, **{
            m: {"p50_ms": spread([c["latency_ms"]["p50"] for c in mine if c["mode"] == m]),
                "p99_ms": spread([c["latency_ms"]["p99"] for c in mine if c["mode"] == m]),
                "req_per_s": round(percentile([c["req_per_s"] for c in mine if c["mode"] == m], 50), 1),
                "router_cpu_ms_per_turn": spread([c["router_cpu_ms_per_turn"] for c in mine if c["mode"] == m]),
                "postgres_cpu_ms_per_turn": spread([c["postgres_cpu_ms_per_turn"] for c in mine if c["mode"] == m])}
            for m in MODES}}
        for store in STORES:
            added = [p50[store][r] - p50["off"][r] for r in rounds if p50[store].get(r) is not None]
            out[key][store]["added_p50_ms"] = spread(added)
            out[key][store]["added_p50_ms_per_round"] = [round(a, 3) for a in added]
            verdicts[f"{key}, {store}: added p50 (median over rounds) <= {TARGET_MS} ms"] = {
                "value": out[key][store]["added_p50_ms"]["p50"], "target": TARGET_MS,
                "pass": out[key][store]["added_p50_ms"]["p50"] <= TARGET_MS}
    return {"cells": out, "verdicts": verdicts,
            "cells_with_errors": [_name(c) for c in cells if c["errors_total"] or c["latency_ms"]["p50"] is None],
            "contended_cells": [_name(c) for c in cells if c["contended"]]}


def _name(cell: dict) -> str:
    return f"{cell['mode']}/{cell['workload']}/c{cell['concurrency']}/round {cell['round']}"


def table(result: dict) -> str:
    """bench/README.md's table: per workload and concurrency, p50 / p99 of each mode, each store's added p50 with its
    spread and verdict, and the router's CPU per turn in each mode (PostgreSQL's: plus the server's)."""
    s, derived = result["settings"], result["derived"]
    rows = []
    for d in derived["cells"].values():
        row = [d["workload"], str(d["concurrency"]), _p50_p99(d["off"])]
        for store in STORES:
            added = d[store]["added_p50_ms"]
            row += [_p50_p99(d[store]), f"{added['p50']:+.2f} ({added['p10']:+.2f}..{added['p90']:+.2f}) "
                                        + met(added["p50"] <= TARGET_MS)]
        cpu = [d[m]["router_cpu_ms_per_turn"]["p50"] for m in MODES]
        server = d["postgresql"]["postgres_cpu_ms_per_turn"]["p50"]
        row.append(f"{cpu[0]:.2f}/{cpu[1]:.2f}/{cpu[2]:.2f}+{server:.2f}")
        rows.append(row)
    contended = len(derived["contended_cells"])
    return (f"{s['rounds']} rounds of {s['duration_s']:g} s, FAKE workers, client latency (ms), medians over rounds"
            f" (p10..p90){f', {contended} cells contended' if contended else ''}:\n\n"
            + grid(["workload", "clients", "false p50/p99", "SQLite p50/p99", "added p50", "PostgreSQL p50/p99",
                    "added p50", "router CPU ms/turn: false/SQLite/PostgreSQL+server"], rows))


def _p50_p99(mode: dict) -> str:
    return f"{num(mode['p50_ms']['p50'])}/{num(mode['p99_ms']['p50'])}"


def draw(result: dict, path: Path) -> None:
    from matplotlib import ticker

    derived = result["derived"]["cells"]
    fig, axes = pyplot().subplots(1, 2, figsize=(13, 5))
    colors = dict(zip(derived, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"), strict=False))
    for key, d in derived.items():
        for store, marker in zip(STORES, ("o", "s"), strict=True):
            added = d[store]["added_p50_ms_per_round"]
            axes[0].plot(range(len(added)), added, marker=marker, color=colors[key],
                         linestyle="-" if store == "sqlite" else "--", label=f"{key}, {LABELS[store]}")
    axes[0].axhline(TARGET_MS, color="red", linestyle=":", label=f"target {TARGET_MS:g} ms")
    axes[0].axhline(0, color="#9e9e9e", linewidth=0.8)
    axes[0].set_title("Added p50 over store: false, per round (ms)")
    axes[0].set_xlabel("round")
    axes[0].xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    axes[0].legend(fontsize=7)
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs = [j + (i - 1) * width for j in range(len(derived))]
        axes[1].bar(xs, [d[mode]["p50_ms"]["p50"] for d in derived.values()], width, label=f"{LABELS[mode]} p50")
        axes[1].scatter(xs, [d[mode]["p99_ms"]["p50"] for d in derived.values()], marker="_", s=200, color="black",
                        label="p99" if i == 0 else None)
    axes[1].set_xticks(range(len(derived)), list(derived))
    axes[1].set_yscale("log")
    axes[1].set_title("Client latency per turn, median over rounds (ms, log)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"What the Responses store adds at the router, FAKE workers ({stamp(result['machine'])})")
    save(fig, path)
