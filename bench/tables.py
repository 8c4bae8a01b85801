"""bench/README.md's result tables, rendered from the results files under bench/results/ so that they cannot go
stale: each table sits between `<!-- table: NAME -->` and `<!-- end table -->`, and NAME is a key of TABLES.

`python -m bench.tables` rewrites the README's tables from the results files; `--check` only says whether they
differ (tests/unit/test_bench_tables.py fails when they do). The numbers are the ones the benchmarks derived and
stored (bench.report, bench.pd_report, bench.cluster_report, bench.persistence_report); this only lays them out.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench import pd_report, tracing_cost, tracing_instructions

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
README = BENCH / "README.md"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n).*?(<!-- end table -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def grid(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def source(result: dict, name: str) -> str:
    m = result["machine"]
    return f"From `bench/results/{name}` ({m['date_utc'][:10]}, commit `{m['git_commit'][:7]}`):"


# --- router (bench.router; derived by bench.report) ---------------------------------------------------------------

def router(name: str = "router.json") -> str:
    result = load(name)
    cells = {(c["target"], c["concurrency"], c["mode"]): c for c in result["cells"]}
    added = result["derived"]["added_latency_ms"]
    rows = []
    for conc in result["settings"]["concurrency"]:
        for mode in result["settings"]["modes"]:
            ours, sgl = cells[("ours", conc, mode)], cells[("sglang", conc, mode)]
            a, b = added[f"ours/c{conc}/{mode}"], added[f"sglang/c{conc}/{mode}"]
            rate = "chunks_per_s" if mode == "stream" else "req_per_s"
            rows.append([conc, mode, f"{num(a['p50'])} / {num(a['p99'])}", f"{num(b['p50'])} / {num(b['p99'])}",
                         f"{ours[rate]:.0f} / {sgl[rate]:.0f} ({ours[rate] / sgl[rate]:.2f}x)",
                         f"{num(ours['target_cpu_ms_per_request'], 3)} / {num(sgl['target_cpu_ms_per_request'], 3)}"])
    return source(result, name) + "\n\n" + grid(
        ["concurrency", "mode", "added p50 / p99 ms, ours", "added p50 / p99 ms, SGLang's",
         "ours / SGLang's req/s (plain) or chunks/s (stream)", "CPU ms per request, ours / SGLang's"], rows)


# --- KV persistence (bench.persistence; derived by bench.persistence_report) ---------------------------------------

HITS = (("storage", "from disk"), ("disk", "page cache dropped"), ("memory", "from memory"))


def persistence(name: str) -> str:
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
        targets = [[goal, num(t.get("on"), 3), num(t.get("off"), 3), t.get("target", "-"), _met(t["met"])]
                   for goal, t in result["targets"].items() if "on" in t]
        cold = result["targets"]["cold_chunked"]
        targets.append(["cold_chunked: cold on <= cold off - SGLang's recomputed attention",
                        f"{cold['cold_on_s']:.1f} s", f"{cold['cold_off_s']:.1f} s",
                        f"<= {cold['floor_s']:.1f} s", _met(cold["met"])])
        text += "\n\n" + grid(["target", "on", "off", "target", "met"], targets)
    return text


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


# --- PD (bench.pd; derived by bench.pd_report) ---------------------------------------------------------------------

PD_COLUMNS = (("itl_p50", "ITL p50 ms", 0), ("itl_p99", "ITL p99 ms", 0), ("ttft_probe_p50", "probe TTFT p50 ms", 0),
              ("ttft_long_p50", "long TTFT p50 ms", 0), ("tokens_per_s", "output tok/s", 1),
              ("goodput", "goodput streams/s", 2))


def pd(name: str, cells: bool = True) -> str:
    result = load(name)
    parts = []
    for model, run in result["models"].items():
        d = run["derived"]
        rows = []
        for key, row in d["summary"].items():
            mode, label = key.split("/")
            rows.append([label, mode, *(pd_report._fmt(row[k]["repeats"], digits) for k, _, digits in PD_COLUMNS)])
        ratios = [[label, *(_ratio(pairs[k]) for k, _, _ in PD_COLUMNS)]
                  for label, pairs in d["ratios_pd_over_colocated"].items()]
        idle = ", ".join(f"{m} {v:.0f} ms" for m, v in d["idle_itl_ms"].items())
        table = grid(["long prompts", "mode", *(h for _, h, _ in PD_COLUMNS)], rows) + "\n\n" if cells else ""
        parts.append(f"{source(result, name)} {model}, repeat 0 / repeat 1; idle ITL p50 {idle}\n\n" + table
                     + grid(["long prompts", *(f"PD / colocated {h.removesuffix(' ms')}" for _, h, _ in PD_COLUMNS)],
                            ratios))
    return "\n\n".join(parts)


def _ratio(pair: dict) -> str:
    if pair["ratio"] is None:
        return "-"
    return f"{pair['ratio']:.2f} ({num(pair['min'])}-{num(pair['max'])})"


def pd_verdicts(name: str = "pd.json") -> str:
    result = load(name)
    rows = []
    for run in result["models"].values():
        for goal, v in run["derived"]["verdicts"].items():
            if goal.startswith("(closed loop"):  # for the record only: the probes are what a short prompt is judged by
                continue
            got = v.get("ratio", f"PD {v.get('pd')} vs colocated {v.get('colocated')}")
            rows.append([goal, "-" if got is None else got, ", ".join(map(str, v.get("paired", []))) or "-",
                         _met(v["pass"])])
    return grid(["target", "PD / colocated", "per repeat", "verdict"], rows)


# --- cluster (bench.cluster; derived by bench.cluster_report) -------------------------------------------------------

RATIO_METRICS = (("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50"), ("median_tpot_ms", "TPOT p50"),
                 ("request_goodput", "goodput"), ("cached_tokens", "cached tokens"))


def cluster_ratios(name: str) -> str:
    result = load(name)
    rows = []
    for comparison, metrics in result["derived"]["ratios"].items():
        cells = []
        for metric, _ in RATIO_METRICS:
            v = metrics.get(metric)
            if not v:
                cells.append("-")
                continue
            paired = f" ({', '.join(f'{x:.2f}' for x in v['paired'])})" if v.get("paired") else ""
            cells.append(f"{v['ratio']:.2f}{' noise' if v['within_noise'] else ''}{paired}")
        rows.append([comparison, *cells])
    idle = "; ".join(f"{variant}: {v['cores']:.3f} cores" for variant, v in result["derived"]
                     ["idle_local_cluster"].items())
    return (source(result, name) + " median ratio, `noise` when the repeats' ranges overlap, in brackets the ratio "
            "within each repeat\n\n" + grid(["comparison", *(h for _, h in RATIO_METRICS)], rows)
            + f"\n\nIdle, the `make up` shape: {idle}.")


# --- idle, decode only, KV hand-off ---------------------------------------------------------------------------------

def idle(name: str = "idle.json") -> str:
    result = load(name)
    cpu = result["idle_cpu_cores"]
    rows = [[tree, f"{cores:.4f}"] for tree, cores in cpu["per_tree"].items()]
    rows.append(["**total**", f"**{cpu['local_yaml_shape_total']:.4f}**"])
    kinds = [[kind, f"{cores:.4f}"] for kind, cores in cpu["per_thread_kind"].items()]
    return (source(result, name) + f" {cpu['seconds']:.0f} s idle\n\n" + grid(["process tree", "cores"], rows)
            + "\n\n" + grid(["process, thread kind x count", "cores"], kinds))


def decode_only(name: str = "decode-only.json") -> str:
    result = load(name)
    batches = result["batches"]
    rows = [["output tokens/s", *(f"{b['output_throughput']['median']:.0f}" for b in batches)],
            ["TPOT p50 / p99 (ms)", *(f"{b['median_tpot_ms']['median']:.1f} / {b['p99_tpot_ms']['median']:.1f}"
                                      for b in batches)],
            ["errors", *(str(b["errors"]) for b in batches)]]
    return (source(result, name) + f" medians of {result['repeats']} repeats, {result['input_len']} prompt tokens, "
            f"{result['output_len']} new\n\n" + grid(["requests in flight", *(str(b["batch"]) for b in batches)], rows))


def kv_handoff(name: str = "kv-handoff.json") -> str:
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


# --- routing (bench.routing, bench.routing_decision, bench.routing_restarts) ----------------------------------------

def _spread(cell: dict | None, fmt: str = ".2f") -> str:
    return "-" if not cell else f"{cell['median']:{fmt}} ({cell['min']:{fmt}}-{cell['max']:{fmt}})"


def routing(name: str = "routing.json") -> str:
    result = load(name)
    summary = result["summary"]
    rows = [[policy, _spread(cell.get("cached_over_oracle")), _spread(cell.get("ttft_p50_s")),
             _spread(summary["ttft_p50_over_round_robin"].get(policy)), str(cell["errors"])]
            for policy, cell in summary["policies"].items()]
    verdicts = "; ".join(f"{name.replace('_', ' ')} {v['value'] if isinstance(v['value'], int) else num(v['value'], 3)}"
                         f" ({v['target']}): {_met(v['met'])}" for name, v in result["verdicts"].items())
    settings = result["settings"]
    shape, rate = settings["shape"], settings.get("rate")
    load_ = f"arriving at {rate:g}/s (open loop)" if rate else f"{settings['concurrency']} in flight (closed loop)"
    return (source(result, name) + f" medians (min-max) of {settings['repeats']} repeats, "
            f"{shape['requests']} requests each, {load_}, {shape['tenants']} tenants\n\n"
            + grid(["policy", "cached / oracle", "TTFT p50 s", "TTFT p50 / round robin's", "errors"], rows)
            + f"\n\ncache_aware's targets: {verdicts}.")


def routing_decision(name: str = "routing-decision.json") -> str:
    result = load(name)
    cells = "; ".join(f"{d['route'].rsplit('/', 1)[-1]} {d['tokens']} tokens {d['prompt']}: {d['p50_ms']:.2f} / "
                      f"{d['p99_ms']:.2f}" for d in result["decisions"])
    events, verdict = result["events"], result["verdict"]
    credit = max(d.get("credit_p50_ms", 0) for d in result["decisions"])
    return (source(result, name) + f" p50 / p99 ms: {cells}; then the credit: {credit:.1f} ms. Events: "
            f"{events['cpu_us_per_token']:.1f} µs of CPU a stored token, {100 * events['core_share']:.2f}% of a core "
            f"at {events['tokens_per_s']:.0f} tokens/s ({events['rate_from']}). Targets: {_met(verdict['met'])}.")


def routing_restarts(name: str = "routing-restarts.json") -> str:
    if not (RESULTS / name).is_file():  # a variant not run yet (the others' results are all committed)
        return "Not run yet."
    result = load(name)
    rows = [[p["phase"], str(p["requests"]), str(p["errors"]), num(p["hit_ratio"], 3), num(p["blind_share"], 3),
             num(p["seconds_to_recover"], 1)] for p in result["phases"]]
    once_back = ("\n\nRestarted prefill, once back: {requests} requests, {cached_tokens} / {prompt_tokens} prompt "
                 "tokens cached ({storage_tokens} from the store), {predicted} predicted.".format(**back)
                 if (back := result.get("restarted_prefill", {}).get("once_back")) else "")
    return (source(result, name) + f" steady (its second half) hit ratio {result['steady_hit_ratio']:.3f}\n\n"
            + grid(["phase", "requests", "errors", "hit ratio", "blind share", "s until back"], rows) + once_back)


TABLES: dict[str, Callable[[], str]] = {
    "router": router,
    "persistence-llama-small": lambda: persistence("persistence-llama-small.json"),
    "persistence-smollm2-sealed-8k": lambda: persistence("persistence-smollm2-sealed-8k.json"),
    "pd": lambda: pd("pd.json"),
    "pd-verdicts": pd_verdicts,
    "pd-fcfs": lambda: pd("pd-fcfs.json", cells=False),
    "cluster-ratios": lambda: cluster_ratios("cluster.json"),
    "idle": idle,
    "decode-only": decode_only,
    "kv-handoff": kv_handoff,
    "routing": routing,
    "routing-open": lambda: routing("routing-chats4-p1500q200-t8-r0.35.json"),
    "routing-decision": routing_decision,
    "routing-restarts": routing_restarts,
    "routing-restarts-shared": lambda: routing_restarts("routing-restarts-shared.json"),
    "tracing-cost": lambda: source(load("tracing-cost.json"), "tracing-cost.json") + " "
    + tracing_cost.table(load("tracing-cost.json")),
    "tracing-instructions": lambda: source(load("tracing-instructions.json"), "tracing-instructions.json") + " "
    + tracing_instructions.table(load("tracing-instructions.json")),
}


def render(text: str) -> str:
    """The README's text with every marked table rendered again from its results file."""
    def one(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise KeyError(f"bench/README.md marks a table {name!r} that bench/tables.py does not know")
        return f"{match.group(1)}{TABLES[name]()}\n{match.group(3)}"
    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = README.read_text()
    new = render(text)
    if "--check" in argv:
        print("bench/README.md's tables are up to date" if new == text else "bench/README.md's tables are stale")
        return 0 if new == text else 1
    README.write_text(new)
    print(f"rendered {len(BLOCK.findall(new))} tables into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
