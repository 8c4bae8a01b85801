"""The attention alone, in this process: SGLang's CPU extend attention (`_run_sdpa_forward_extend`) against
pdcluster's (pdcluster/plugins/cpu_attention/ops.extend) at a model's head shape, for the extends one benchmark prompt
causes: each chunk of a cold prefill (SGLang's chunked-prefill size) and a hit's uncached tail. Times all layers (one
layer's median x layers), the two alternating. What SGLang's costs beyond pdcluster's is the attention a cache or an
earlier chunk already paid for: the most a prefill can gain from the adaptation, so the floor of its TTFT."""

from __future__ import annotations

import statistics
import time

import torch


def extends(tokens: int, chunk: int, stored: int) -> dict[str, list[tuple[int, int]]]:
    """(cached prefix, new tokens) of each extend: a cold prefill's chunks; a hit's one extend past `stored`."""
    return {"cold": [(start, min(chunk, tokens - start)) for start in range(0, tokens, chunk)],
            "hit": [(stored, tokens - stored)]}


def _inputs(prefix: int, new: int, heads: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> dict:
    length = prefix + new
    return dict(query=torch.randn(new, heads, head_dim, generator=gen),
                output=torch.empty(new, heads, head_dim),
                k_cache=torch.randn(length, kv_heads, head_dim, generator=gen),
                v_cache=torch.randn(length, kv_heads, head_dim, generator=gen),
                req_to_token=torch.arange(length).unsqueeze(0), req_pool_indices=torch.tensor([0]),
                seq_lens=torch.tensor([length]), extend_prefix_lens=torch.tensor([prefix]),
                extend_seq_lens=torch.tensor([new]))


def measure(dims: dict, tokens: int, chunk: int, stored: int, runs: int = 3) -> dict:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from pdcluster.plugins.cpu_attention import internals, ops

    sglang_own, backend = internals.check()["extend"], object.__new__(TorchNativeAttnBackend)
    heads, kv_heads, head_dim, layers = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["layers"]
    scale = head_dim ** -0.5
    impls = {
        "sglang": lambda a: sglang_own(backend, **a, scaling=scale, enable_gqa=heads != kv_heads, causal=True),
        "pdcluster": lambda a: ops.extend(**a, scaling=scale),
    }
    gen = torch.Generator().manual_seed(0)
    result = {}
    with torch.inference_mode():
        for case, parts in extends(tokens, chunk, stored).items():
            row: dict = {"extends": [list(p) for p in parts]}
            totals = dict.fromkeys(impls, 0.0)
            for prefix, new in parts:
                args = _inputs(prefix, new, heads, kv_heads, head_dim, gen)
                times: dict[str, list[float]] = {name: [] for name in impls}
                for run in range(runs + 1):  # the first of each is a warm-up
                    for name, impl in (impls.items() if run % 2 else reversed(impls.items())):
                        started = time.perf_counter()
                        impl(args)
                        times[name].append(time.perf_counter() - started)
                for name in impls:
                    totals[name] += statistics.median(times[name][1:])
            for name, seconds in totals.items():
                row[f"{name}_s"] = round(seconds * layers, 3)
            row["recomputed_s"] = round(row["sglang_s"] - row["pdcluster_s"], 3)
            result[case] = row
    return {"tokens": tokens, "chunked_prefill_size": chunk, "stored_tokens": stored, "runs": runs,
            "statistic": "median per extend and layer, x layers", **result}
