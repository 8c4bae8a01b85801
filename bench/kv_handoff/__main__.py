"""`python -m bench.kv_handoff` (`make bench-kv-handoff`): the time to move one prompt's KV from a prefill to a decode
through Mooncake's TCP transport, the way SGLang's mooncake connector does it, against a plain loopback TCP socket
moving the same bytes in the same run.

Two processes per configuration (bench/kv_handoff/peers.py): a decode owning a KV pool of SmolLM2-135M's shape (per
layer K and V tensors, pages of 64 tokens, room for the largest prompt) and a prefill with the same pool, each with its
own TransferEngine. Per prompt size (1k-8k tokens) and page layout (contiguous: one transfer per tensor; scattered: one
per page per tensor, as SGLang sends when neither side's pages are neighbours), the prefill writes the prompt's pages
into the decode in one batch_transfer_sync_write (SGLang's default), then sends the same blocks over the socket; each
`--repeats` times after a warm-up, every landing checked by CRC. Configurations: Mooncake's defaults, then the knobs an
SGLang user can set in the environment (MC_TCP_* and SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES), each in fresh
processes (Mooncake reads them once). Writes bench/results/kv-handoff.json and .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from bench.harness.machine import machine
from bench.harness.paths import REPO, RESULTS
from bench.kv_handoff import report
from bench.kv_handoff.peers import decode, prefill
from bench.kv_handoff.plan import PAGE_TOKENS, kv_bytes_per_token, load_shape, page_item_bytes
from pdcluster.worker.environment import MOONCAKE_TCP_ENV

MODEL = REPO / "models" / "smollm2-135m-instruct"
SIZES = (1024, 2048, 4096, 8192)
BASE_ENV = {"MC_LOG_LEVEL": "ERROR"}
# name -> (environment, SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES). Defaults (Mooncake 0.3.13 tcp_transport.cpp):
# 4 lanes (TCP connections) per peer, 64 KiB slices, 1024 queued transfers per peer; SGLang: one batch.
CONFIGS = {
    "default": ({}, 0),
    "lanes_1": ({"MC_TCP_LANES_PER_PEER": "1"}, 0),
    "lanes_8": ({"MC_TCP_LANES_PER_PEER": "8"}, 0),
    "slice_1MiB": ({"MC_TCP_SLICE_SIZE": str(1 << 20)}, 0),
    "queue_8192": ({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192"}, 0),
    "batch_16_pages": ({}, 16),
    "pdcluster": (dict(MOONCAKE_TCP_ENV), 0),  # what pdcluster's workers get on mooncake_tcp (pdcluster/worker/plan.py)
    "default_again": ({}, 0),  # the A/A twin of "default", last: how far two identical runs differ (the noise)
}


def run_config(name: str, env: dict, max_batch_pages: int, shape: dict, sizes, layouts, repeats: int,
               timeout: float) -> dict:
    item = page_item_bytes(shape)
    tensors = 2 * shape["layers"]
    pool_pages = max(sizes) // PAGE_TOKENS
    cells = [{"layout": lay, "tokens": t, "pages": t // PAGE_TOKENS} for lay in layouts for t in sizes]
    full_env = {**BASE_ENV, **env}
    if max_batch_pages:
        full_env["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"] = str(max_batch_pages)  # recorded; applied by plan()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=decode, args=(b, full_env, tensors, pool_pages * item), daemon=True),
             ctx.Process(target=prefill, args=(a, res_w, full_env, tensors, pool_pages * item, item, cells, repeats,
                                               max_batch_pages), daemon=True)]
    print(f"{name}: {full_env}", flush=True)
    for p in procs:
        p.start()
    try:
        if not res_r.poll(timeout):
            raise TimeoutError(f"{name}: no result in {timeout:.0f} s")
        return res_r.recv()
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_handoff", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "scattered"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=8, help="steady-state runs per cell, after one warm-up")
    parser.add_argument("--timeout", type=float, default=240, help="per configuration")
    parser.add_argument("--out", default=str(RESULTS / "kv-handoff.json"))
    args = parser.parse_args(argv)
    shape = load_shape(args.model)
    per_token = kv_bytes_per_token(shape)
    started = time.perf_counter()
    measured_on = machine()
    configs = {}
    for name in args.configs:
        env, max_batch_pages = CONFIGS[name]
        configs[name] = run_config(name, env, max_batch_pages, shape, args.sizes, args.layouts, args.repeats,
                                   args.timeout)
    result = {
        "machine": measured_on, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "duration_s": round(time.perf_counter() - started, 1),
        "model": Path(args.model).name, "kv_shape": shape, "kv_bytes_per_token": per_token,
        "formula": (f"{shape['layers']} layers x 2 (K,V) x {shape['kv_heads']} KV heads x {shape['head_dim']} head dim"
                    f" x {shape['elem_bytes']} bytes ({shape['dtype']}) = {per_token} bytes/token"),
        "page_tokens": PAGE_TOKENS, "page_item_bytes": page_item_bytes(shape), "repeats": args.repeats,
        "transport": "Mooncake TransferEngine, P2PHANDSHAKE, protocol tcp, loopback 127.0.0.1",
        "configs": configs, "derived": report.derive(configs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report.draw(result, out.with_suffix(".png"))
    print(json.dumps(result["derived"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['duration_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
