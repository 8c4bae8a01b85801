"""Draw bench/results/cluster.png: per target, the median of the repeats as a bar and every repeat as a dot."""

from __future__ import annotations

from pathlib import Path

from bench.harness.plot import pyplot, save, stamp

PANELS = (
    ("random", ("request_throughput", "requests/s"), ("output_throughput", "output tokens/s"),
     ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"),
     ("p99_itl_ms", "ITL p99 ms"), ("request_goodput", "goodput req/s")),
    ("serial", ("median_ttft_ms", "TTFT p50 ms"), ("median_tpot_ms", "TPOT p50 ms")),
    ("shared-prefix", ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
     ("cached_tokens", "cached prompt tokens"), ("request_throughput", "requests/s")),
)
COLORS = {"ours": "#1f77b4", "ours-twin": "#aec7e8", "sglang": "#ff7f0e", "colocated": "#2ca02c", "prefix": "#9467bd",
          "round_robin": "#8c564b", "busy-poll ours": "#7f7f7f"}


def _label(key: str) -> str:
    session, target, _ = key.split("/")
    return f"busy-poll {target}" if session == "busy-poll" else target


def draw(result: dict, path: Path) -> None:
    summary = result["summary"]
    rows = [(workload, metric, title) for workload, *metrics in PANELS for metric, title in metrics]
    cols = 4
    extra = 3  # idle CPU, paired ratios, machine speed
    fig, axes = pyplot().subplots((len(rows) + extra + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.2 * 4))
    axes = axes.flatten()
    for ax, (workload, metric, title) in zip(axes, rows, strict=False):
        keys = [k for k in summary if k.endswith(f"/{workload}") and metric in summary[k]]
        for i, key in enumerate(keys):
            cell, label = summary[key][metric], _label(key)
            ax.bar(i, cell["median"], color=COLORS.get(label, "#333333"), alpha=0.75)
            ax.scatter([i] * len(cell["runs"]), cell["runs"], color="black", s=10, zorder=3)
            ax.annotate(f"{cell['median']:.3g}", (i, cell["median"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(keys)), [_label(k) for k in keys], rotation=20, fontsize=7)
        ax.set_title(f"{workload}: {title}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[len(rows)]
    idle = result.get("idle_cpu_cores", {})
    names = list(idle)
    ax.bar(range(len(names)), [idle[n]["local_yaml_shape_total"] for n in names], color="#555555")
    ax.axhline(0.10, color="red", ls="--", lw=1, label="target 0.1 core")
    ax.set_xticks(range(len(names)), [n.replace("sleep_on_idle_", "sleep-on-idle ") for n in names], fontsize=8)
    ax.set_title("idle local cluster (1P+1D, router, bootstrap): cores", fontsize=9)
    ax.legend(fontsize=7)
    _paired(axes[len(rows) + 1], result["derived"]["ratios"])
    _machine_speed(axes[len(rows) + 2], result["runs"])
    for ax in axes[len(rows) + extra:]:
        ax.axis("off")
    m = result["machine"]
    model = Path(result["settings"].get("model", "models/tiny-llama")).name
    fig.suptitle(f"pdcluster cluster benchmark (real SGLang, CPU, {model}) - {stamp(m)}; bars: median of "
                 f"{result['settings']['repeats']} repeats, dots: each repeat", fontsize=10)
    save(fig, path)


def _paired(ax, ratios: dict) -> None:
    """Each comparison's requests/s ratio within each repeat: what a drift of the machine between repeats hides."""
    names = [n for n, m in ratios.items() if m.get("request_throughput", {}).get("paired")]
    for i, name in enumerate(names):
        cell = ratios[name]["request_throughput"]
        ax.scatter([i] * len(cell["paired"]), cell["paired"], color="black", s=12, zorder=3)
        ax.annotate(f"{cell['ratio']:.2f}", (i, max(cell["paired"])), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="red", ls="--", lw=1)
    ax.set_yscale("log")
    labels = [n.replace(" (random)", "").replace("one at a time", "1 by 1") for n in names]
    ax.set_xticks(range(len(names)), labels, rotation=25, ha="right", fontsize=6)
    ax.set_title("requests/s ratio within each repeat", fontsize=9)


def _machine_speed(ax, runs: list[dict]) -> None:
    """The fixed CPU task timed before every run, in run order: the machine's own speed over the benchmark."""
    for session in dict.fromkeys(r["session"] for r in runs):
        points = [(i, r.get("machine_probe_ms")) for i, r in enumerate(runs) if r["session"] == session]
        ax.plot([i for i, _ in points], [p for _, p in points], marker="o", ms=3, label=session)
    ax.legend(fontsize=7)
    ax.set_xlabel("run, in order", fontsize=8)
    ax.set_title("machine: fixed CPU task before each run, ms", fontsize=9)
    ax.grid(alpha=0.3)


def draw_idle(result: dict, path: Path) -> None:
    """bench.cluster --idle-only: the cores each process of the idle `make up` shape used."""
    plt = pyplot()
    cores = result["idle_cpu_cores"]
    processes = cores["per_process"]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(processes) + 1.5))
    ax.barh(list(processes), list(processes.values()), color="#1f77b4")
    ax.invert_yaxis()
    ax.set_xlabel("cores (CPU seconds per second)")
    ax.set_title(f"idle {cores['seconds']:.0f} s: {cores['local_yaml_shape_total']:.3f} cores in all; "
                 f"{stamp(result['machine'])}", fontsize=9)
    save(fig, path)
