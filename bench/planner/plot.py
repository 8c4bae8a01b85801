"""The gym's picture: SLO goodput per worker of the best static split, the oracle and the planner for every trace
and fleet size; and, on the shifting trace at the largest fleet, the prefill count each follows over time."""

from __future__ import annotations

from pathlib import Path

from bench.harness.plot import pyplot, save, stamp


def _prefills(splits: list) -> tuple[list[float], list[int]]:
    times, counts = [], []
    for at, split in splits:
        times.append(at / 3600)
        counts.append(int(str(split).split("P")[0]))
    return times, counts


def draw(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(14, 5))
    labels, series = [], {"best static": [], "oracle": [], "planner": []}
    for name, by_size in result["cells"].items():
        for workers, cell in by_size.items():
            labels.append(f"{name}\nx{workers}")
            series["best static"].append(cell["best_static"]["goodput_per_worker"])
            series["oracle"].append(cell["oracle"]["goodput_per_worker"])
            series["planner"].append(cell["planner"]["goodput_per_worker"])
    width = 0.27
    for k, (policy, values) in enumerate(series.items()):
        bars.bar([i + (k - 1) * width for i in range(len(labels))], values, width, label=policy)
    bars.set_xticks(range(len(labels)), labels, fontsize=8)
    bars.set_ylabel("SLO-good requests / worker / s")
    bars.set_title("SLO goodput per worker")
    bars.legend()
    shifting = result["cells"].get("shifting", {})
    if shifting:
        workers = max(shifting, key=int)
        cell = shifting[workers]
        end = result["hour_s"] * 3 / 3600
        for label, splits in (("planner", cell["planner"]["splits"]), ("oracle", cell["oracle"]["splits"])):
            times, counts = _prefills(splits)
            lines.step([*times, end], [*counts, counts[-1]], where="post", label=label)
        best = int(cell["best_static"]["split"].split("P")[0])
        lines.axhline(best, color="grey", linestyle=":", label=f"best static ({cell['best_static']['split']})")
        for k in (1, 2):
            lines.axvline(k * result["hour_s"] / 3600, color="black", linewidth=0.5)
        lines.set_xlabel("simulated hours (prompt-heavy | answer-heavy | prompt-heavy)")
        lines.set_ylabel(f"prefill workers of {workers}")
        lines.set_title(f"shifting trace, {workers} workers: the split over time")
        lines.legend()
    fig.suptitle(f"planner gym on {result['profile']} ({stamp(result['machine'])})", fontsize=9)
    save(fig, path)
