"""What bench.kv_handoff moves, without moving it: one prompt's KV bytes for a model config, and the (src, dst, length)
transfers SGLang's mooncake connector builds for it (sglang/srt/disaggregation/mooncake/conn.py, 0.5.23).

SGLang's MHA KV pool holds, per layer, a K tensor and a V tensor of [slots, kv_heads, head_dim]; the connector
registers each of those 2 x layers tensors with Mooncake, and its item length is one PAGE of one tensor
(page_size x kv_heads x head_dim x dtype bytes). For a request it takes the prefill's and the decode's page indices,
groups runs that are contiguous on BOTH sides (`group_concurrent_contiguous`, common/utils.py) and, for every tensor
(all K layers, then all V layers), adds one transfer per run; all tensors' transfers go into ONE
`batch_transfer_sync_write` call (`_send_kvcache_generic` -> `process_layers`), unless
SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES (default 0: off) splits the page indices into batches of that many.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PAGE_TOKENS = 64  # the page size measured (SGLang's --page-size; pdcluster's configs use 64)


def kv_shape(config: dict) -> dict:
    """Layers, KV heads, head dim and element size of a Hugging Face Llama-style config.json."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    return {"layers": config["num_hidden_layers"], "kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": head_dim, "dtype": dtype, "elem_bytes": elem}


def kv_bytes_per_token(shape: dict) -> int:
    """layers x 2 (K and V) x kv_heads x head_dim x element bytes."""
    return shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * shape["elem_bytes"]


def page_item_bytes(shape: dict, page_tokens: int = PAGE_TOKENS) -> int:
    """One page of one layer's K (or V) tensor: SGLang's kv_item_len."""
    return page_tokens * shape["kv_heads"] * shape["head_dim"] * shape["elem_bytes"]


def load_shape(model_dir: str | Path) -> dict:
    return kv_shape(json.loads((Path(model_dir) / "config.json").read_text()))


def group_contiguous(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, pages) per run of indices contiguous on both sides: SGLang's
    group_concurrent_contiguous, which breaks wherever either side's next index is not the previous one + 1."""
    if len(src) != len(dst):
        raise ValueError("src and dst page lists differ in length")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def transfer_blocks(src_ptrs: list[int], dst_ptrs: list[int], item_len: int,
                    runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(src address, dst address, length) for every tensor (in the order given) and every run, as
    _send_kvcache_generic's set_transfer_blocks builds them."""
    return [(sp + s * item_len, dp + d * item_len, n * item_len)
            for sp, dp in zip(src_ptrs, dst_ptrs, strict=True) for s, d, n in runs]


def page_indices(pages: int, pool_pages: int, layout: str, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prefill and decode page indices of one request. `contiguous`: pages 0..n-1 on both sides (a fresh server's
    allocator); `scattered`: pages drawn at random from each side's pool, so no two neighbours merge (a server whose
    free list has been churned by other requests): SGLang then sends one transfer per page per tensor."""
    if layout == "contiguous":
        return list(range(pages)), list(range(pages))
    if layout != "scattered":
        raise ValueError(f"unknown layout {layout!r}")
    rng = random.Random(seed)
    return rng.sample(range(pool_pages), pages), rng.sample(range(pool_pages), pages)


def plan(src_ptrs: list[int], dst_ptrs: list[int], item_len: int, src_pages: list[int], dst_pages: list[int],
         max_batch_pages: int = 0) -> list[list[tuple[int, int, int]]]:
    """The batches of (src, dst, length) one request is sent as: one batch of every tensor's runs (SGLang's
    default), or with max_batch_pages > 0 (SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES) one batch per slice of that
    many page indices, runs grouped within the slice."""
    if max_batch_pages <= 0 or len(src_pages) <= max_batch_pages:
        return [transfer_blocks(src_ptrs, dst_ptrs, item_len, group_contiguous(src_pages, dst_pages))]
    return [transfer_blocks(src_ptrs, dst_ptrs, item_len,
                            group_contiguous(src_pages[i:i + max_batch_pages], dst_pages[i:i + max_batch_pages]))
            for i in range(0, len(src_pages), max_batch_pages)]
