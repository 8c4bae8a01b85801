"""`python -m bench.cluster --decode-only` (or `python -m bench.cluster.decode_only`): decode throughput and TPOT at
several batch sizes, on a decode worker with no prefill (configs/decode-only.yaml: SGLang's `fake` KV transfer).

The worker is started by pdcluster's own launcher (`python decode.py --config configs/decode-only.yaml`). For each
batch size B, sglang.bench_serving sends 3 x B requests of 256 prompt tokens and 64 new tokens with at most B in
flight, so the decode batch stays at B but for the last requests' tail. What it measures: decode compute alone
(the batch's forward passes over prompt-length KV, sampling, detokenizing, HTTP). What it does not: the prefill, the
KV transfer, or the answers' quality (the KV is never written: the context is garbage, the text meaningless).
Writes bench/results/decode-only.json and .png (`--quick`: decode-only-quick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import machine, procs, serving
from bench.harness.markdown import grid, load, source
from bench.harness.paths import RESULTS
from bench.harness.plot import pyplot, save

CONFIG = "configs/decode-only.yaml"
PORT = 21600
# SGLang's marker for "no prefill: fake KV" (sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST). Every request must
# carry it: SGLang 0.5.23 is meant to treat a request without a bootstrap host as fake on this backend, but its
# scheduler then crashes building the (None) bootstrap address. bench_serving's --fake-prefill sends it.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def fake_kv(room: int = 0) -> dict:
    return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": room}


def start_worker(log_dir: Path, port: int = PORT) -> procs.Proc:
    return procs.start("decode-only", [sys.executable, "decode.py", "--config", CONFIG, "--port", str(port)],
                       log_dir, port)


def wait_ready(worker: procs.Proc, timeout: float = 600) -> float:
    body = json.dumps({"text": "ready?", "sampling_params": {"max_new_tokens": 1}, **fake_kv()}).encode()
    return procs.wait_ready(worker, lambda: procs.request(worker.port, "POST", "/generate", body)[0] == 200, timeout)


def batch_workload(batch: int, output_len: int) -> serving.Workload:
    return serving.random_ids(f"decode-b{batch}", max(6, 3 * batch), rate=None, concurrency=batch,
                              output_len=output_len, notes=f"at most {batch} in flight", extra=("--fake-prefill",))


def draw(result: dict, path: Path) -> None:
    rows = result["batches"]
    xs = [r["batch"] for r in rows]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [r["output_throughput"]["median"] for r in rows], marker="o")
    left.set_title("decode throughput (output tokens/s, median)")
    right.plot(xs, [r["median_tpot_ms"]["median"] for r in rows], marker="o", label="TPOT p50")
    right.plot(xs, [r["p99_tpot_ms"]["median"] for r in rows], marker="^", label="TPOT p99")
    right.set_title("time per output token (ms)")
    right.legend()
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("requests in flight (decode batch)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"decode only, fake KV (no prefill, no transfer) - {result['machine']['date_utc']}", fontsize=10)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.decode_only", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch sizes 1 and 4, one repeat")
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 4 16 32 (--quick: 1 4)")
    parser.add_argument("--repeats", type=int, help="default 2 (--quick: 1)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, help="result path without extension")
    args = parser.parse_args(argv)
    batches = args.batches or ([1, 4] if args.quick else [1, 4, 16, 32])
    repeats = args.repeats or (1 if args.quick else 2)
    out = args.out or RESULTS / ("decode-only-quick" if args.quick else "decode-only")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-decode-only-"))
    t0 = time.monotonic()
    worker = start_worker(log_dir)
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    try:
        wait_ready(worker)
        serving.run(batch_workload(batches[-1], 8), worker.url, log_dir, "warm-up", seed=0, slo={"tpot": 1e9})
        for repeat in range(repeats):
            for batch in batches if repeat % 2 == 0 else batches[::-1]:
                row = serving.run(batch_workload(batch, args.output_len), worker.url, log_dir,
                                  f"b{batch}-{repeat}", seed=repeat + 1, slo={"tpot": 1e9})
                runs[batch].append(row)
                print(f"[decode-only {time.monotonic() - t0:4.0f}s] batch {batch}: {row['output_throughput']:.0f} "
                      f"tok/s, TPOT p50 {row['median_tpot_ms']:.1f} ms, errors {row['errors']}", flush=True)
    finally:
        worker.stop()
    keys = ("output_throughput", "request_throughput", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
            "median_ttft_ms")
    rows = [{"batch": b, **{k: {"median": round(statistics.median(r[k] for r in runs[b]), 3),
                                "runs": [round(r[k], 3) for r in runs[b]]} for k in keys},
             "errors": sum(r["errors"] for r in runs[b])} for b in batches]
    result = {"benchmark": "decode only on fake KV (configs/decode-only.yaml): decode compute, no prefill, no KV "
                           "transfer, garbage context", "config": CONFIG, "input_len": 256,
              "output_len": args.output_len, "repeats": repeats, "machine": machine.machine(), "batches": rows,
              "wall_seconds": round(time.monotonic() - t0)}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(result, Path(f"{out}.png"))
    print(f"decode-only: wrote {out}.json and {out}.png in {result['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def readme_table(name: str = "decode-only.json") -> str:
    """bench/README.md's table: throughput and TPOT per batch size."""
    result = load(name)
    batches = result["batches"]
    rows = [["output tokens/s", *(f"{b['output_throughput']['median']:.0f}" for b in batches)],
            ["TPOT p50 / p99 (ms)", *(f"{b['median_tpot_ms']['median']:.1f} / {b['p99_tpot_ms']['median']:.1f}"
                                      for b in batches)],
            ["errors", *(str(b["errors"]) for b in batches)]]
    return (source(result, name) + f" medians of {result['repeats']} repeats, {result['input_len']} prompt tokens, "
            f"{result['output_len']} new\n\n" + grid(["requests in flight", *(str(b["batch"]) for b in batches)], rows))
