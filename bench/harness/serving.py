"""SGLang's own serving benchmark (`sglang.bench_serving`), run in this process against one target.

In-process rather than `python -m sglang.bench_serving` per run: importing SGLang takes 10-20 s of CPU on this 2-core
machine, which would be paid again for every one of the dozens of runs. Each run gets exactly the command line the
module's own CLI parses (`cli_main`), its JSON result file, and its printed report in a log file.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.local.models import DEMO

# What each run reports, from bench_serving's result record.
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "request_goodput", "slo_attainment")


@dataclass(frozen=True)
class Workload:
    """One bench_serving load: its dataset options, the arrival process and how many prompts."""
    name: str
    args: tuple[str, ...]
    prompts: int
    rate: float | None  # Poisson arrivals per second; None sends them all at once
    concurrency: int | None = None  # at most this many in flight
    notes: str = ""
    extra: tuple[str, ...] = field(default=())

    def argv(self, seed: int) -> list[str]:
        argv = [*self.args, "--num-prompts", str(self.prompts), "--seed", str(seed), *self.extra]
        argv += ["--request-rate", "inf" if self.rate is None else str(self.rate)]
        if self.concurrency:
            argv += ["--max-concurrency", str(self.concurrency)]
        return argv


def random_ids(name: str, prompts: int, rate: float | None, concurrency: int | None = None, notes: str = "",
               input_len: int = 256, output_len: int = 32, extra: tuple[str, ...] = ()) -> Workload:
    # random-ids: random token ids of exactly these lengths (the `random` dataset downloads ShareGPT first).
    return Workload(name, ("--dataset-name", "random-ids", "--random-input-len", str(input_len),
                           "--random-output-len", str(output_len), "--random-range-ratio", "1.0"),
                    prompts, rate, concurrency, notes, extra)


def shared_prefix(name: str, groups: int, per_group: int, concurrency: int, notes: str = "") -> Workload:
    """SGLang's generated-shared-prefix data: `groups` system prompts of 512 tokens, each with `per_group` questions
    of 64 tokens, in random order."""
    return Workload(name, ("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
                           "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", "512",
                           "--gsp-question-len", "64", "--gsp-output-len", "32", "--gsp-range-ratio", "1.0",
                           "--cache-report"),
                    groups * per_group, None, concurrency, notes)


def run(workload: Workload, base_url: str, out_dir: Path, tag: str, seed: int, slo: dict[str, float],
        model: str = DEMO) -> dict:
    """One bench_serving run against `model` (its folder: bench_serving's tokenizer); returns the METRICS of its result
    (plus cache hits where reported)."""
    from sglang.benchmark import serving  # heavy: imported once, on first use

    result_file, log_file = out_dir / f"{tag}.jsonl", out_dir / f"{tag}.log"
    result_file.unlink(missing_ok=True)
    argv = ["bench_serving", "--backend", "sglang", "--base-url", base_url, "--model", model, "--tokenizer", model,
            "--ready-check-timeout-sec", "0", "--warmup-requests", "2", "--disable-tqdm",
            "--output-file", str(result_file), "--tag", tag,
            "--goodput", *(f"{k}:{v:g}" for k, v in slo.items()), *workload.argv(seed)]
    saved = sys.argv
    with open(log_file, "w", encoding="utf-8") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            sys.argv = argv
            serving.cli_main()
        finally:
            sys.argv = saved
    if not result_file.exists():
        raise RuntimeError(f"bench_serving wrote no result for {tag}; see {log_file}")
    record = json.loads(result_file.read_text().splitlines()[-1])
    row = {k: record.get(k) for k in METRICS}
    row["completed"], row["duration_s"] = record.get("completed"), record.get("duration")
    row["errors"] = workload.prompts - (record.get("completed") or 0)
    report = record.get("cache_report")
    if report:
        row["cached_tokens"], row["cache_hit_rate_pct"] = report["total_cached_tokens"], report["cache_hit_rate_pct"]
    return row
