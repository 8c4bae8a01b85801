"""Draw bench/results/router.png from the report: throughput per target and concurrency, and added latency."""

from __future__ import annotations

from pathlib import Path

from bench.harness.plot import pyplot, save, stamp

COLORS = {"direct": "#9e9e9e", "ours": "#1f77b4", "sglang": "#ff7f0e"}
LABELS = {"direct": "direct to decode", "ours": "our router", "sglang": "SGLang Rust router"}


def _short(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 10:
        return f"{value:.0f}"
    return f"{value:.2g}"


def _grouped(ax, groups: list[str], series: dict[str, list[float]], colors: dict[str, str], labels: dict[str, str],
             log: bool = True, floor: float = 0.01) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        values = [v if v is not None and v == v else None for v in values]
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        shown = [max(v, floor) if v is not None else 0 for v in values]
        bars = ax.bar(xs, shown, width, color=colors[name], label=labels[name])
        for bar, v in zip(bars, values, strict=True):
            if v is not None:
                ax.annotate(_short(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both")


def draw(report: dict, path: Path) -> None:
    cells = report["cells"]
    concurrencies = sorted({c["concurrency"] for c in cells})
    targets = [t for t in ("direct", "ours", "sglang") if any(c["target"] == t for c in cells)]

    def value(target: str, conc: int, mode: str, key: str) -> float | None:
        cell = next((c for c in cells if (c["target"], c["concurrency"], c["mode"]) == (target, conc, mode)), None)
        if cell is None:
            return None
        return cell["latency_ms"][key[8:]] if key.startswith("latency_") else cell[key]

    fig, axes = pyplot().subplots(2, 2, figsize=(14, 10))
    groups = [f"c={c}" for c in concurrencies]
    ax = axes[0][0]
    _grouped(ax, groups, {t: [value(t, c, "plain", "req_per_s") for c in concurrencies] for t in targets},
             COLORS, LABELS)
    ax.set_title("Non-streamed /generate: requests/s (higher is better)")
    ax.set_ylabel("requests/s (log)")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    _grouped(ax, groups, {t: [value(t, c, "stream", "chunks_per_s") for c in concurrencies] for t in targets},
             COLORS, LABELS)
    chunks = report["settings"]["chunks_per_stream"]
    ax.set_title(f"Streamed /generate ({chunks} SSE chunks a request): chunks/s (higher is better)")
    ax.set_ylabel("chunks/s (log)")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    added = report["derived"]["added_latency_ms"]
    keys = [k for k in added if int(k.split("/")[1][1:]) <= 32]
    routers = [r for r in ("ours", "sglang") if any(k.startswith(r + "/") for k in keys)]
    cases = sorted({k.split("/", 1)[1] for k in keys}, key=lambda s: (int(s.split("/")[0][1:]), s))
    series, colors, labels = {}, {}, {}
    for router in routers:
        for q in ("p50", "p99"):
            name = f"{router} {q}"
            series[name] = [added.get(f"{router}/{case}", {}).get(q) for case in cases]
            colors[name] = COLORS[router] + ("" if q == "p50" else "80")
            labels[name] = f"{LABELS[router]} added {q}"
    _grouped(ax, [c.replace("/", " ") for c in cases], series, colors, labels)
    ax.axhline(1.0, color="green", ls="--", lw=1, label="target: added p50 <= 1 ms")
    ax.axhline(5.0, color="red", ls="--", lw=1, label="target: added p99 <= 5 ms")
    ax.set_title("Latency added over direct (router minus direct, lower is better)")
    ax.set_ylabel("ms (log; <= 0 drawn at 0.01)")
    ax.set_ylim(top=max([v for s in series.values() for v in s if v] + [10]) * 30)
    ax.legend(fontsize=7, ncol=2, loc="upper left")

    ax = axes[1][1]
    for q, marker in (("p50", "o"), ("p99", "^")):
        for mode, ls in (("plain", "-"), ("stream", ":")):
            for t in targets:
                ys = [value(t, c, mode, f"latency_{q}") for c in concurrencies]
                ax.plot(concurrencies, ys, marker=marker, ls=ls, color=COLORS[t], label=f"{t} {mode} {q}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (connections, one request in flight each)")
    ax.set_ylabel("latency ms (log)")
    ax.set_title("Client latency: p50 (circles) and p99 (triangles); plain solid, stream dotted")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=3)

    m, contended = report["machine"], report["derived"]["contended_cells"]
    note = f"; {len(contended)} of {len(cells)} cells contended by other work" if contended else ""
    fig.suptitle(f"pdcluster router benchmark on FAKE SGLang workers - {stamp(m)}, cores busy before start "
                 f"{m.get('cores_busy_before_start', '?')}{note}", fontsize=11)
    save(fig, path, dpi=110)
