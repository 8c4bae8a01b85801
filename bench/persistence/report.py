"""bench.persistence's results: medians per series and mode, ratios (over cold, and on over off paired within each
repeat), ITL percentiles, the KV persistence targets (TARGETS), the machine, the plot."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from bench.harness.machine import machine as report_machine
from bench.harness.markdown import grid, load, met, num, source
from bench.harness.plot import pyplot, save

SERIES = ("cold", "storage", "disk", "memory")
MODES = ("on", "off")
TARGETS = {"memory": 0.1, "storage": 0.2, "disk": 0.2, "chat": 0.1}
HITS = (("storage", "from disk"), ("disk", "page cache dropped"), ("memory", "from memory"))  # README columns


def _median(values) -> float:
    return round(statistics.median(values), 4)


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50_ms": round(pick(0.5) * 1e3, 2), "p90_ms": round(pick(0.9) * 1e3, 2),
            "p99_ms": round(pick(0.99) * 1e3, 2), "mean_ms": round(statistics.fmean(ordered) * 1e3, 2)}


def _rows(samples: dict, lengths, bandwidth: dict, page_bytes: float, page: int) -> list[dict]:
    rows = []
    for n in lengths:
        stored = (n - 1) // page * page  # whole pages, and the last token is always computed (it makes the logits)
        kv_bytes = stored // page * page_bytes
        row = {"prompt_tokens": n, "stored_tokens": stored, "kv_bytes": int(kv_bytes),
               "floor_device_s": round(kv_bytes / bandwidth["device_bytes_per_s"], 4)}
        for series in SERIES:
            row[f"{series}_ttft_s"] = _median(r["seconds"] for r in samples[series][n])
        for series in SERIES[1:]:
            row[f"{series}_over_cold"] = round(row[f"{series}_ttft_s"] / row["cold_ttft_s"], 4)
        for series in ("storage", "disk"):  # the sealed storage's own clock: checking the pages read from disk
            verify = [r["verify_s"] for r in samples[series][n] if "verify_s" in r]
            if verify:
                row[f"{series}_verify_s"] = _median(verify)
                row[f"{series}_verify_share"] = round(row[f"{series}_verify_s"] / row[f"{series}_ttft_s"], 4)
        row["runs"] = {series: samples[series][n] for series in SERIES}
        rows.append(row)
    return rows


def _chat(runs: list[dict]) -> dict:
    return {"prompt_tokens": runs[0]["prompt_tokens"], "turn2_prompt_tokens": runs[0]["turn2_prompt_tokens"],
            "turn1_ttft_s": _median(r["turn1_ttft_s"] for r in runs),
            "turn2_ttft_s": _median(r["turn2_ttft_s"] for r in runs),
            "turn2_over_turn1": _median(r["turn2_ttft_s"] / r["turn1_ttft_s"] for r in runs),
            "turn2_cached_tokens": [r["turn2_cached_tokens"] for r in runs],
            "turn2_storage": [r["turn2_storage"] for r in runs], "runs": runs}


def report(model: dict, server: dict, lengths, repeats: int, samples: dict, restarts: list, bandwidth: dict,
           page_bytes: float, op: dict, page: int = 64) -> dict:
    rows = {m: _rows(samples[m], lengths, bandwidth, page_bytes, page) for m in MODES}
    paired = []  # on / off of the same prompt in the same repeat, then the median over repeats
    for n in lengths:
        paired.append({"prompt_tokens": n, **{f"{s}_on_over_off": _median(
            a["seconds"] / b["seconds"] for a, b in zip(samples["on"][s][n], samples["off"][s][n], strict=False))
            for s in SERIES}})
    chat = {m: _chat(samples[m]["chat"]) for m in MODES}
    itl = {m: _percentiles([x for r in samples[m]["chat"] for x in r["itl_s"]]) for m in MODES}
    blocks = {m: [_percentiles(r["itl_s"])["p50_ms"] for r in samples[m]["chat"]] for m in MODES}
    noise = max(max(b) / min(b) - 1 for b in blocks.values())
    itl["on_over_off"] = {k: round(itl["on"][k] / itl["off"][k], 3) for k in ("p50_ms", "p90_ms", "p99_ms")}
    itl["p50_ms_per_repeat"], itl["repeat_to_repeat_spread"] = blocks, round(noise, 3)
    on, off, longest = rows["on"][-1], rows["off"][-1], lengths[-1]
    saved = _median(b["seconds"] - a["seconds"] for a, b in zip(samples["on"]["cold"][longest],
                                                                  samples["off"]["cold"][longest], strict=False))
    targets = {f"{s}_over_cold_at_{longest}": {"on": on[f"{s}_over_cold"], "off": off[f"{s}_over_cold"],
                                               "target": TARGETS[s], "met": on[f"{s}_over_cold"] <= TARGETS[s]}
               for s in ("memory", "storage", "disk")}
    targets["cold_chunked"] = {
        "rule": "cold TTFT with the adaptation faster by at least the attention SGLang recomputes "
                "(bench/cpu_attention/extend.py)",
        "cold_on_s": on["cold_ttft_s"], "cold_off_s": off["cold_ttft_s"], "saved_s": saved,
        "recomputed_attention_s": op["cold"]["recomputed_s"],
        "floor_s": round(off["cold_ttft_s"] - op["cold"]["recomputed_s"], 3),
        "met": saved >= op["cold"]["recomputed_s"]}
    targets["chat_turn2_over_turn1"] = {"on": chat["on"]["turn2_over_turn1"], "off": chat["off"]["turn2_over_turn1"],
                                        "target": TARGETS["chat"],
                                        "met": chat["on"]["turn2_over_turn1"] <= TARGETS["chat"]}
    targets["itl_unmoved"] = {"p50_on_over_off": itl["on_over_off"]["p50_ms"], "noise": itl["repeat_to_repeat_spread"],
                              "met": abs(itl["on_over_off"]["p50_ms"] - 1) <= max(noise, 0.05)}
    return {
        "benchmark": "TTFT of long prompts cold, from disk, from memory, a chat's next turn, and decode ITL, with "
                     "pdcluster's CPU attention on and off",
        "settings": {"lengths": list(lengths), "repeats": repeats, "page_size": page, "max_new_tokens": 1,
                     "modes": "two clusters side by side, cluster.cpu_attention true (on) / false (off), each its "
                              "own KV directory; every measurement alternates between them, the first alternating",
                     "statistic": "median over repeats; on/off paired within a repeat",
                     "path": "client -> router -> prefill + decode (PD, CPU)",
                     "configs": ["configs/prefill-persistent.yaml", "configs/decode-persistent.yaml"],
                     "overrides": {"max-total-tokens": 20480, "dtype": "float32"},
                     "chat": "turn 1 streamed, 128 tokens (ITL); turn 2 = turn 1 + answer + 64 tokens"},
        "model": model, "server": server, "machine": machine(), "restart_seconds": restarts,
        "read_bandwidth": bandwidth, "page_bytes": page_bytes, "results": rows, "on_over_off": paired,
        "chat": chat, "itl": itl, "attention_op": op, "targets": targets,
    }


def machine() -> dict:
    """bench.harness.machine's, with the load at the end (a persistence run takes half an hour on a shared machine)."""
    return {**report_machine(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ttft_ax, ratio_ax, itl_ax) = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 3, 2]})
    colors = {"cold": "#d62728", "storage": "#1f77b4", "disk": "#17becf", "memory": "#2ca02c"}
    labels = {"cold": "cold", "storage": "from disk (page cache)", "disk": "from disk (page cache dropped)",
              "memory": "from memory"}
    for mode, style in (("on", "o-"), ("off", "x--")):
        rows = result["results"][mode]
        lengths = [r["prompt_tokens"] for r in rows]
        for series, color in colors.items():
            ttft_ax.plot(lengths, [r[f"{series}_ttft_s"] for r in rows], style, color=color,
                         label=f"{labels[series]}, {mode}")
            if series != "cold":
                ratio_ax.plot(lengths, [r[f"{series}_over_cold"] for r in rows], style, color=color,
                              label=f"{labels[series]}, {mode}")
    for target, color in ((0.1, "#2ca02c"), (0.2, "#1f77b4")):
        ratio_ax.axhline(target, ls=":", color=color, label=f"target {target}x")
    for ax, ylabel in ((ttft_ax, "time to first token (s)"), (ratio_ax, "TTFT over cold TTFT (same mode)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    chat = result["chat"]
    ratio_ax.set_title(f"chat's next turn over its first: {chat['on']['turn2_over_turn1']:.2f}x on, "
                       f"{chat['off']['turn2_over_turn1']:.2f}x off ({chat['on']['prompt_tokens']} tokens)", fontsize=8)
    itl = result["itl"]
    itl_ax.boxplot([[x * 1e3 for r in chat[m]["runs"] for x in r["itl_s"]] for m in MODES], showfliers=False)
    itl_ax.set_xticks([1, 2], list(MODES))
    itl_ax.set_ylabel("decode inter-token latency (ms)")
    itl_ax.set_title(f"ITL p50 on/off {itl['on_over_off']['p50_ms']:.3f}x", fontsize=8)
    m = result["model"]
    fig.suptitle(f"pdcluster CPU attention on/off, 1 prefill + 1 decode on 2 CPU cores: {m['name']} "
                 f"({(m['parameters'] or 0) / 1e6:.0f}M params, {m['kv_bytes_per_token'] // 1024} KiB KV/token)",
                 fontsize=10)
    save(fig, path, dpi=110)


def summary(result: dict, out: Path) -> None:
    for mode in MODES:
        for row in result["results"][mode]:
            print(f"{mode:3s} {row['prompt_tokens']:6d} tokens: cold {row['cold_ttft_s']:.3f}s  storage "
                  f"{row['storage_ttft_s']:.3f}s  disk {row['disk_ttft_s']:.3f}s  memory {row['memory_ttft_s']:.3f}s"
                  f"  verifying pages: {row.get('storage_verify_share', '?')} of storage's TTFT, "
                  f"{row.get('disk_verify_share', '?')} of disk's")
    for name, target in result["targets"].items():
        print(f"target {name}: {'met' if target['met'] else 'NOT met'} {target}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def readme_table(name: str) -> str:
    """bench/README.md's tables of a run: TTFT per prompt length and mode, the seals' share, the targets."""
    result = load(name)
    modes = result["results"] if isinstance(result["results"], dict) else {"-": result["results"]}
    rows = [[row["prompt_tokens"], mode, f"{row['cold_ttft_s']:.2f} s"]
            + [f"{row[f'{s}_ttft_s']:.2f} s ({row[f'{s}_over_cold']:.3f}x)" for s, _ in HITS]
            for rows in zip(*modes.values(), strict=True) for mode, row in zip(modes, rows, strict=True)]
    repeats = result["settings"]["repeats"]
    text = source(result, name) + f" {repeats} repeat(s), medians; each hit over its cold TTFT\n\n"
    text += grid(["prompt tokens", "cpu_attention", "cold", *(label for _, label in HITS)], rows)
    verified = [[row["prompt_tokens"], mode, *(f"{row[f'{s}_verify_s']:.2f} s ({row[f'{s}_verify_share']:.1%})"
                                               for s in ("storage", "disk"))]
                for rows in zip(*modes.values(), strict=True) for mode, row in zip(modes, rows, strict=True)
                if "storage_verify_s" in row and "disk_verify_s" in row]
    if verified:
        text += "\n\nChecking the pages' seals (pdcluster/kvstore/page_seal.py), and its share of the hit's TTFT:\n\n"
        text += grid(["prompt tokens", "cpu_attention", "from disk", "page cache dropped"], verified)
    if "targets" in result:
        targets = [[goal, num(t.get("on"), 3), num(t.get("off"), 3), t.get("target", "-"), met(t["met"])]
                   for goal, t in result["targets"].items() if "on" in t]
        cold = result["targets"]["cold_chunked"]
        targets.append(["cold_chunked: cold on <= cold off - SGLang's recomputed attention",
                        f"{cold['cold_on_s']:.1f} s", f"{cold['cold_off_s']:.1f} s",
                        f"<= {cold['floor_s']:.1f} s", met(cold["met"])])
        text += "\n\n" + grid(["target", "on", "off", "target", "met"], targets)
    return text
