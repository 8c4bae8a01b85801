"""bench.openai.clients' verdict on guidellm's JSON reports (one per endpoint): every request answered, none errored or
left incomplete, every answer parsed (text, the asked token count, streamed in pieces); then TTFT/ITL percentiles per
endpoint and concurrency, the summary bench/results/clients.json holds, and its picture.

guidellm exits 0 whatever its requests did: it files a failed one (an HTTP error, an SSE line that is not JSON, an
error event in the stream) under `requests.errored` with `info.error`, and counts it in `metrics.request_totals`.
An answer whose text sits where it does not look (a chat delta without `content`) it counts as successful, with no
text: hence the checks on each answer.

`python -m bench.openai.clients_report REPORT.json... [--out PATH]` checks and summarizes saved reports again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from bench.harness import plot

PERCENTILES = ("p50", "p90", "p99")
# summary key: guidellm's metric (under benchmarks[].metrics, each split successful / errored / incomplete / total)
METRICS = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms",
           "tpot_ms": "time_per_output_token_ms", "latency_s": "request_latency"}
SHORT = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
EXAMPLES = 3  # error messages quoted per cell: the first few say what went wrong, the rest repeat it


def _label(bench: dict) -> str:
    backend = bench["config"]["backend"]
    fmt = backend.get("request_format", "?")
    return f"{SHORT.get(fmt, fmt)} c{bench['config']['strategy'].get('streams', '?')}"


def _expected_requests(bench: dict) -> int | None:
    """The cell's max_requests constraint: a list with one count per cell when `--override profile.streams` made
    several cells, at the cell's own index."""
    constraint = bench["config"].get("constraints", {}).get("max_requests")
    if not constraint:
        return None
    count = constraint["args"]["count"]
    return count[constraint.get("current_index") or 0] if isinstance(count, list) else count


def _answer_problem(request: dict, output_tokens: int | None, stream: bool) -> str | None:
    """Why a request guidellm counted as successful was not parsed whole, or None."""
    if request.get("info", {}).get("error"):
        return f"error recorded on a successful request: {request['info']['error']}"
    if not (request.get("output") or "").strip():
        return "no text in the answer"
    if output_tokens is not None and request.get("output_tokens") != output_tokens:
        return f"{request.get('output_tokens')} output tokens, asked for {output_tokens} (ignore_eos)"
    if request.get("time_to_first_token_ms") is None:
        return "no first token time"
    # A streamed answer that arrived as one piece was not streamed (or its chunks were not read as chunks).
    if stream and (request.get("info", {}).get("timings", {}).get("token_iterations") or 0) < 2:
        return "not streamed: the tokens came in one piece"
    return None


def check(report: dict) -> list[str]:
    """Every problem in one guidellm report, one line each; empty when it is clean."""
    benches = report.get("benchmarks") or []
    if not benches:
        return ["the report has no benchmark (guidellm stopped before any cell ran)"]
    spec = report.get("config", {}).get("spec", {})
    data = spec.get("data") or [{}]
    output_tokens = data[0].get("output_tokens")
    problems = []
    for bench in benches:
        label = _label(bench)
        stream = bool(bench["config"]["backend"].get("stream"))
        totals = bench["metrics"]["request_totals"]
        requests = bench.get("requests", {})
        for kind in ("errored", "incomplete"):
            if totals.get(kind):
                # the message's first line (httpx adds a line of advice), each distinct one once, with its count
                errors = Counter(str((r.get("info") or {}).get("error")).replace("\\n", "\n").splitlines()[0][:200]
                                 for r in requests.get(kind) or [])
                quoted = "; ".join(f"{n} x {msg}" for msg, n in errors.most_common(EXAMPLES))
                problems.append(f"{label}: {totals[kind]} request(s) {kind}" + (f": {quoted}" if quoted else ""))
        expected = _expected_requests(bench)
        if expected is not None and totals.get("successful", 0) < expected:
            # Seen once, under strace: the cell ended with a request still in flight, filed nowhere. Failed all the
            # same: an answer guidellm never recorded is one nobody checked.
            lost = (bench.get("scheduler_state") or {}).get("processing_requests")
            problems.append(f"{label}: {totals.get('successful', 0)} of {expected} requests answered" +
                            (f" ({lost} still in flight when guidellm ended the cell)" if lost else ""))
        bad = Counter(p for r in requests.get("successful") or [] if (p := _answer_problem(r, output_tokens, stream)))
        if bad:
            quoted = "; ".join(f"{n} x {why}" for why, n in bad.most_common(EXAMPLES))
            problems.append(f"{label}: {bad.total()} answer(s) not parsed whole: {quoted}")
    return problems


def _stats(metric: dict | None, scale: float = 1.0) -> dict:
    """The successful requests' percentiles; p50's confidence interval (guidellm's, 95%) is the noise around it."""
    ok = (metric or {}).get("successful") or {}
    if not ok.get("count"):  # guidellm writes zeros for a cell with no successful request
        ok = {}
    pct = ok.get("percentiles") or {}
    out = {p: round(pct[p] * scale, 2) if pct.get(p) is not None else None for p in PERCENTILES}
    ci = (ok.get("percentile_cis") or {}).get("p50")
    out["p50_ci"] = [round(ci["lower"] * scale, 2), round(ci["upper"] * scale, 2)] if ci else None
    out["mean"] = round(ok["mean"] * scale, 2) if ok.get("mean") is not None else None
    return out


def summarize(report: dict) -> list[dict]:
    """One row per cell (endpoint x concurrent streams): request counts, latency percentiles, throughput."""
    rows = []
    for bench in report.get("benchmarks") or []:
        metrics = bench["metrics"]
        rows.append({
            "cell": _label(bench), "endpoint": bench["config"]["backend"].get("request_format"),
            "streams": bench["config"]["strategy"].get("streams"), "stream": bench["config"]["backend"].get("stream"),
            "requests": {k: metrics["request_totals"].get(k, 0) for k in ("successful", "errored", "incomplete")},
            **{key: _stats(metrics.get(name)) for key, name in METRICS.items()},
            "requests_per_s": round(metrics["requests_per_second"]["successful"]["mean"], 3),
            "output_tokens_per_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
            "duration_s": round(bench.get("duration") or 0, 1),
        })
    return rows


def result(reports: dict[str, dict], extra: dict | None = None) -> dict:
    """The bench's summary over all reports (name -> report): cells, problems, and whether it passed."""
    problems = [f"{name}: {p}" for name, rep in reports.items() for p in check(rep)] or (
        [] if reports else ["no guidellm report to check"])
    versions = {rep.get("metadata", {}).get("guidellm_version") for rep in reports.values()}
    cells = [row for rep in reports.values() for row in summarize(rep)]
    return {"benchmark": "guidellm (a third-party client) against the router: every request answered and parsed",
            "guidellm_version": ", ".join(sorted(str(v) for v in versions)), **(extra or {}), "cells": cells,
            "requests": sum(sum(c["requests"].values()) for c in cells),
            "errors": sum(c["requests"]["errored"] + c["requests"]["incomplete"] for c in cells),
            "problems": problems, "passed": not problems}


def draw(summary: dict, path: Path) -> None:
    cells = summary["cells"]
    fig, axes = plot.pyplot().subplots(1, 2, figsize=(11, 4))
    xs = range(len(cells))
    panels = (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        p50 = [c[key]["p50"] or 0 for c in cells]
        # guidellm's 95% interval around p50, where it has enough samples for one (else a zero-length bar)
        cis = [c[key]["p50_ci"] or [v, v] for v, c in zip(p50, cells, strict=True)]
        err = [[max(0.0, v - lo) for v, (lo, _) in zip(p50, cis, strict=True)],
               [max(0.0, hi - v) for v, (_, hi) in zip(p50, cis, strict=True)]]
        ax.bar(xs, p50, yerr=err, capsize=4, label="p50 (95% CI)")
        ax.scatter(xs, [c[key]["p99"] or 0 for c in cells], marker="^", color="black", zorder=3, label="p99")
        ax.set_xticks(list(xs), [c["cell"] for c in cells])
        ax.set_xlabel("endpoint, concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    verdict = "passed" if summary["passed"] else f"FAILED: {len(summary['problems'])} problem(s)"
    machine = summary.get("machine")
    fig.suptitle(f"guidellm {summary['guidellm_version']} against the router, {verdict}"
                 + (f" - {plot.stamp(machine)}" if machine else ""), fontsize=10)
    plot.save(fig, path)


def write(summary: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(summary, indent=1) + "\n")
    draw(summary, Path(f"{out}.png"))


def report_lines(summary: dict) -> list[str]:
    lines = [f"{c['cell']:>16}: {c['requests']['successful']} ok, {c['requests']['errored']} errored, "
             f"{c['requests']['incomplete']} incomplete; TTFT p50 {c['ttft_ms']['p50']} ms p99 {c['ttft_ms']['p99']}"
             f" ms; ITL p50 {c['itl_ms']['p50']} ms p99 {c['itl_ms']['p99']} ms" for c in summary["cells"]]
    return lines + [f"problem: {p}" for p in summary["problems"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.openai.clients_report", description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="guidellm JSON reports (--output kind=json)")
    parser.add_argument("--out", type=Path, help="summary path without extension (default: print only)")
    args = parser.parse_args(argv)
    summary = result({p.name: json.loads(p.read_text()) for p in args.reports})
    print("\n".join(report_lines(summary)))
    if args.out:
        write(summary, args.out)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
