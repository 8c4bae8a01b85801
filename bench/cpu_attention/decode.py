"""`python -m bench.cpu_attention.decode`: one decode step's attention, in this process, no server. SGLang's CPU decode
attention (`_run_sdpa_forward_decode`: per sequence, a K/V gather by indexing and an SDPA call) against pdcluster's
(pdcluster/plugins/cpu_attention/ops.decode: one index_select and one SDPA for the batch), and pdcluster's op called
sequence by sequence (what batching adds beyond the faster gather). SmolLM2-135M's shape (models/.../config.json),
float32 as the CPU profile serves it, `--tokens` per sequence (the i-th one i tokens longer: padding), every layer its
own K/V pool (as in a server: one layer's gather does not find the previous layer's rows in the CPU cache), slots
scattered in pages of `--page` tokens. A step: the call once per layer. The implementations alternate; median and min of
`--repeats` steps (after a warm-up), in ms. This machine is shared: run it with nice, and repeat."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.harness.paths import REPO

CONFIG = REPO / "models" / "smollm2-135m-instruct" / "config.json"


def dims() -> dict:
    config = json.loads(CONFIG.read_text())
    return {"layers": config["num_hidden_layers"], "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"]}


def _batch(batch: int, tokens: int, page: int, shape: dict, gen: torch.Generator) -> tuple[dict, list[dict]]:
    lens = [tokens + i for i in range(batch)]
    pages = [(n + page - 1) // page for n in lens]
    order = torch.randperm(sum(pages) + 4, generator=gen)
    req_to_token = torch.zeros(batch + 8, max(lens) + page, dtype=torch.int32)  # SGLang's int32 table
    used = 0
    for row, (n, count) in enumerate(zip(lens, pages, strict=True)):
        slots = (order[used:used + count, None] * page + torch.arange(page)).reshape(-1)
        req_to_token[row + 8, :n] = slots[:n].int()
        used += count
    pool = (len(order) + 1) * page
    kv = [{"k_cache": torch.randn(pool, shape["kv_heads"], shape["head_dim"], generator=gen),
           "v_cache": torch.randn(pool, shape["kv_heads"], shape["head_dim"], generator=gen)}
          for _ in range(shape["layers"])]
    return {"query": torch.randn(batch, shape["heads"], shape["head_dim"], generator=gen),
            "req_to_token": req_to_token, "req_pool_indices": torch.arange(batch) + 8,
            "seq_lens": torch.tensor(lens)}, kv


def measure(batches: list[int], tokens: int, page: int, repeats: int) -> dict:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from pdcluster.plugins.cpu_attention import internals, ops

    shape = dims()
    sglang_own, backend = internals.check()["decode"], object.__new__(TorchNativeAttnBackend)
    scale = shape["head_dim"] ** -0.5

    def one_by_one(a: dict, layer: dict) -> None:
        for i in range(len(a["seq_lens"])):
            ops.decode(a["query"][i:i + 1], a["output"][i:i + 1], **layer, req_to_token=a["req_to_token"],
                       req_pool_indices=a["req_pool_indices"][i:i + 1], seq_lens=a["seq_lens"][i:i + 1],
                       scaling=scale)

    impls = {
        "sglang": lambda a, layer: sglang_own(backend, **a, **layer, scaling=scale,
                                              enable_gqa=shape["heads"] != shape["kv_heads"]),
        "pdcluster": lambda a, layer: ops.decode(**a, **layer, scaling=scale),
        "pdcluster_per_sequence": one_by_one,
    }
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            args, kv = _batch(batch, tokens, page, shape, gen)
            times: dict[str, list[float]] = {name: [] for name in impls}
            outputs = {}
            for run in range(repeats + 1):  # the first of each is a warm-up
                for name, impl in (impls.items() if run % 2 else reversed(impls.items())):
                    call = {**args, "output": torch.empty_like(args["query"])}
                    started = time.perf_counter()
                    for layer in kv:
                        impl(call, layer)
                    times[name].append(time.perf_counter() - started)
                    outputs[name] = call["output"]
            for name in impls:  # the last layer's output: the same attention, whichever computed it
                torch.testing.assert_close(outputs[name], outputs["sglang"], rtol=1e-5, atol=1e-5)
            row: dict = {"batch": batch}
            for name, seconds in times.items():
                row[f"{name}_ms"] = round(statistics.median(seconds[1:]) * 1e3, 2)
                row[f"{name}_min_ms"] = round(min(seconds[1:]) * 1e3, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"shape": shape, "tokens": tokens, "page": page, "repeats": repeats, "threads": torch.get_num_threads(),
            "statistic": "ms per decode step (all layers), median and min", "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_attention.decode")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--page", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure([int(b) for b in args.batches.split(",")], args.tokens, args.page, args.repeats)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
