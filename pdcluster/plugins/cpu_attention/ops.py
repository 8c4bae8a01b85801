"""Causal extend attention that computes only the new tokens' queries, and decode attention for a whole batch in one
call (`decode`, below), for SGLang's torch_native backend on CPU.

SGLang 0.5.23 (`TorchNativeAttnBackend._run_sdpa_forward_extend`) gives every request of an extend batch a query as
long as its whole sequence, the cached prefix's rows left empty, and runs causal SDPA over all of it: a prompt whose
first P tokens are cached, or the second chunk of a chunked prefill, pays (P + C)^2 / 2 query-key products instead of
the C x P + C^2 / 2 its C new tokens need. Here the C new queries attend in two parts, each with CPU flash attention:
the prefix's keys with no mask (every new token sees all of them) and the new keys with the plain causal mask, then
the two are merged by their log-sum-exps (the same algebra flash attention uses between its own key blocks). SDPA's
`is_causal` aligns its mask to the top left, which is right only when queries and keys start together, hence two parts
and not one call. GQA needs no copies: the CPU flash kernel maps query heads to key heads as `enable_gqa` does.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

# The CPU flash attention op under SDPA; it also returns each row's log-sum-exp, which the public SDPA does not.
FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = getattr(torch.ops.aten, FLASH_OP)(query, key, value, 0.0, causal, scale=scale)
    return out, lse


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int,
           scale: float | None) -> torch.Tensor:
    """Causal attention of the last C positions of a sequence.

    query: [heads, C, dim], the new tokens; key, value: [kv_heads, prefix + C, dim], the whole sequence. Returns
    [heads, C, dim]: row i attends to keys 0 .. prefix + i.
    """
    q, k, v = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    if prefix == 0:  # nothing cached: SGLang's own call, and its own result
        return scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            enable_gqa=query.shape[0] != key.shape[0]).squeeze(0)
    old, old_lse = _flash(q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
    new, new_lse = _flash(q, k[:, :, prefix:], v[:, :, prefix:], True, scale)
    # Each row's softmax mass splits between the two parts as exp(old_lse) : exp(new_lse); the prefix's share is
    # sigmoid(old_lse - new_lse). Merged in float32 whatever the model's dtype (the log-sum-exps are float32).
    share = torch.sigmoid(old_lse - new_lse).unsqueeze(-1)
    return torch.lerp(new.float(), old.float(), share).squeeze(0)


def covers(seq_lens: torch.Tensor, extend_prefix_lens: torch.Tensor | None, extend_seq_lens: torch.Tensor | None,
           query: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `extend` serves this batch: every sequence is its cached prefix plus its new tokens, and values have
    the queries' head size (the flash kernel's case)."""
    if extend_prefix_lens is None or extend_seq_lens is None:
        return False
    if query.shape[-1] != v_cache.shape[-1]:
        return False
    return bool(torch.equal(seq_lens.to(torch.int64), (extend_prefix_lens + extend_seq_lens).to(torch.int64)))


def extend(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
           extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """What `_run_sdpa_forward_extend` computes for causal self-attention, with the same arguments and layouts.

    query, output: [tokens, heads, dim], the batch's new tokens request after request; k_cache, v_cache:
    [slots, kv_heads, dim]; req_to_token[req_pool_indices[i], :seq_lens[i]]: the slots of request i's sequence.
    """
    queries = query.movedim(0, 1)  # [heads, tokens, dim]
    start = 0
    for req, length, prefix, new in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_prefix_lens.tolist(),
                                        extend_seq_lens.tolist(), strict=True):
        end = start + new
        if new:
            slots = req_to_token[req, :length]
            key, value = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)
            if not (query.dtype == key.dtype == value.dtype):  # as SGLang does, e.g. for an fp8 KV cache
                key, value = key.to(query.dtype), value.to(query.dtype)
            output[start:end] = attend(queries[:, start:end], key, value, prefix, scaling).movedim(0, 1)
        start = end
    return output


def covers_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Whether `decode` serves this batch: one query per sequence, every sequence at least one key long, query heads
    a multiple of key heads, and values of the queries' head size."""
    if query.dim() != 3 or query.shape[0] != seq_lens.shape[0] or not len(seq_lens):
        return False
    if query.shape[1] % k_cache.shape[1] or query.shape[-1] != v_cache.shape[-1]:
        return False
    return bool(seq_lens.min() > 0)


def decode(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """What `_run_sdpa_forward_decode` computes for self-attention, for the whole batch at once.

    query, output: [sequences, heads, dim], one token each; k_cache, v_cache: [slots, kv_heads, dim]. SGLang gathers
    each sequence's keys and values by advanced indexing and calls SDPA, sequence after sequence; here one index_select
    (about twice as fast as indexing on CPU) gathers every sequence's slots padded to the longest, and one SDPA call
    attends with the padding masked. GQA without copies: the query heads that share a key head are that head's rows.
    """
    batch, heads, dim = query.shape
    kv_heads, longest = k_cache.shape[1], int(seq_lens.max())
    slots = req_to_token[req_pool_indices, :longest]
    mask = None
    if bool((seq_lens != longest).any()):  # past a shorter sequence's end: slot 0 (any valid one), masked out
        mask = torch.arange(longest, device=slots.device) < seq_lens[:, None]
        slots = slots.masked_fill(~mask, 0)
        mask = mask[:, None, None, :]
    slots = slots.reshape(-1)
    key = k_cache.index_select(0, slots).view(batch, longest, kv_heads, dim).movedim(1, 2)
    value = v_cache.index_select(0, slots).view(batch, longest, kv_heads, dim).movedim(1, 2)
    if not (query.dtype == key.dtype == value.dtype):  # as SGLang does, e.g. for an fp8 KV cache
        key, value = key.to(query.dtype), value.to(query.dtype)
    rows = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    output.copy_(out.reshape(batch, heads, dim))
    return output
