"""bench/results/kv-handoff.png from kv-handoff.json: hand-off time per prompt size (Mooncake per layout and the
socket, default configuration), the Mooncake/socket ratio per configuration against its 2x target, and where
one 4k-token hand-off's time goes (engine start, registration, first contact, the copy)."""

from __future__ import annotations

from pathlib import Path

from bench.plot import pyplot, save, stamp


def _ms(cell: dict, transport: str, key: str = "median_s") -> float:
    """Milliseconds, or NaN where Mooncake failed the cell (matplotlib leaves a gap)."""
    return cell[transport][key] * 1e3 if key in cell[transport] else float("nan")


def draw(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    configs = result["configs"]
    base = configs.get("default") or next(iter(configs.values()))
    layouts = sorted({c["layout"] for c in base["cells"]})

    ax = axes[0]
    for layout, mark in zip(layouts, "os^", strict=False):
        cells = [c for c in base["cells"] if c["layout"] == layout]
        tokens = [c["tokens"] for c in cells]
        for transport, style in (("mooncake", "-"), ("socket", "--")):
            med = [_ms(c, transport) for c in cells]
            p90 = [_ms(c, transport, "p90_s") for c in cells]
            line, = ax.plot(tokens, med, style, marker=mark, label=f"{transport}, {layout} pages")
            ax.fill_between(tokens, med, p90, color=line.get_color(), alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (SmolLM2-135M, 45 KiB/token)")
    ax.set_ylabel("hand-off time, ms (median; band to p90)")
    ax.set_title("one prompt's KV, prefill -> decode (default knobs)\n"
                 "(Mooncake fails a batch of > 2048 transfers: no point)", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[1]
    for k, (name, res) in enumerate(configs.items()):
        for layout, style in zip(layouts, ("-", ":"), strict=False):
            cells = [c for c in res["cells"] if c["layout"] == layout]
            ratios = [c["ratio_mooncake_over_socket"] or float("nan") for c in cells]
            ax.plot([c["tokens"] for c in cells], ratios, style, color=f"C{k}",
                    marker="o" if style == "-" else "s", label=f"{name}, {layout}")
    ax.axhline(2.0, color="red", lw=1, ls="--", label="target at 4k: <= 2x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("Mooncake time / socket time")
    ax.set_title("ratio per configuration (1 = socket's speed)")
    ax.legend(fontsize=7)

    ax = axes[2]
    target = 4096
    names, bars = [], []
    for name, res in configs.items():
        pre = res["prefill"]
        for cell in res["cells"]:
            if cell["tokens"] != target:
                continue
            failed = "median_s" not in cell["mooncake"]
            names.append(f"{name}, {cell['layout']}" + (" (FAILED)" if failed else ""))
            bars.append((pre["init_s"], pre["register_s"], pre["first_contact_one_page_s"],
                         cell["plan_s"], 0.0 if failed else cell["mooncake"]["median_s"]))
    parts = ("engine init", "register pool", "first contact (1 page)", "build transfer list", "copy (median)")
    left = [0.0] * len(bars)
    for i, part in enumerate(parts):
        widths = [b[i] * 1e3 for b in bars]
        ax.barh(names, widths, left=left, label=part)
        left = [x + w for x, w in zip(left, widths, strict=True)]
    socket = [_ms(c, "socket") for res in configs.values() for c in res["cells"]
              if c["tokens"] == target]
    ax.scatter(socket, names, color="black", marker="|", s=300, zorder=3, label="socket copy (median)")
    ax.set_xlabel("ms (prefill side)")
    ax.set_title(f"where a {target}-token hand-off's time goes")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)
    fig.suptitle(f"KV hand-off: Mooncake TCP vs a loopback socket ({stamp(result['machine'])})")
    save(fig, path)
