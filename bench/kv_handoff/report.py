"""bench.kv_handoff's results: the Mooncake/socket ratio per configuration and its verdict, and
bench/results/kv-handoff.png: hand-off time per prompt size (Mooncake per layout and the socket, default
configuration), the ratio per configuration against its 2x target, and where one 4k-token hand-off's time goes
(engine start, registration, first contact, the copy)."""

from __future__ import annotations

from pathlib import Path

from bench.harness.markdown import grid, load, num, source
from bench.harness.plot import pyplot, save, stamp

TARGET_TOKENS, TARGET_RATIO = 4096, 2.0


def derive(configs: dict) -> dict:
    """Ratio Mooncake/socket at the target size per configuration and layout, and the verdict (default config)."""
    at_target = {}
    for name, res in configs.items():
        for cell in res["cells"]:
            if cell["tokens"] == TARGET_TOKENS:
                at_target[f"{name}/{cell['layout']}"] = cell["ratio_mooncake_over_socket"]
    verdicts = {f"mooncake/socket at {TARGET_TOKENS} tokens, default, {lay}":
                {"value": v, "target": f"<= {TARGET_RATIO:g}", "pass": v is not None and v <= TARGET_RATIO}
                for key, v in at_target.items() if key.startswith("default/") for lay in [key.split("/")[1]]}
    measured = {k: v for k, v in at_target.items() if v is not None}
    best = min(measured.items(), key=lambda kv: kv[1]) if measured else None
    failed = [f"{n}/{c['layout']}/{c['tokens']}: {c['mooncake']['error']} after {c['mooncake']['failed_after_s']} s"
              for n, r in configs.items() for c in r["cells"] if "error" in c["mooncake"]]
    unverified = [f"{n}/{c['layout']}/{c['tokens']}/{t}" for n, r in configs.items() for c in r["cells"]
                  for t in ("mooncake", "socket") if "median_s" in c[t] and not c[t]["verified"]]
    twin = {}
    if "default" in configs and "default_again" in configs:
        for a, b in zip(configs["default"]["cells"], configs["default_again"]["cells"], strict=True):
            if a["ratio_mooncake_over_socket"] and b["ratio_mooncake_over_socket"]:
                twin[f"{a['layout']}/{a['tokens']}"] = round(b["ratio_mooncake_over_socket"]
                                                             / a["ratio_mooncake_over_socket"], 3)
    return {"ratio_at_target_tokens": at_target, "aa_twin_ratio_of_ratios": twin, "best_at_target": best,
            "verdicts": verdicts,
            "mooncake_failures": failed, "unverified_landings": unverified}


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


def readme_table(name: str = "kv-handoff.json") -> str:
    """bench/README.md's table: the default configuration per layout and size, and every configuration's ratio."""
    result = load(name)
    rows = []
    for cell in result["configs"]["default"]["cells"]:
        moon, sock = cell["mooncake"], cell["socket"]
        got = (f"{moon['median_s'] * 1e3:.1f} ({moon['gb_per_s']:.2f} GB/s)" if "median_s" in moon
               else f"**failed** ({moon['error']} after {moon['failed_after_s'] * 1e3:.1f} ms)")
        rows.append([cell["layout"], f"{cell['tokens']} ({cell['bytes'] / 1e6:.0f} MB)", cell["transfers"], got,
                     f"{sock['median_s'] * 1e3:.1f} ({sock['gb_per_s']:.2f} GB/s)",
                     num(cell["ratio_mooncake_over_socket"])])
    ratios = result["derived"]["ratio_at_target_tokens"]
    configs = [[config, num(ratios.get(f"{config}/contiguous")), num(ratios.get(f"{config}/scattered"))]
               for config in result["configs"]]
    return (source(result, name) + " the `default` configuration, medians of "
            f"{result['repeats']} runs\n\n"
            + grid(["pages", "tokens", "transfers", "Mooncake ms", "socket ms", "Mooncake / socket"], rows)
            + "\n\nMooncake / socket at 4096 tokens, contiguous / scattered (`-`: Mooncake failed): "
            + "; ".join(f"{c} {a} / {b}" for c, a, b in configs) + ".")
