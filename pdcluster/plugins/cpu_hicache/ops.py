"""The three HiCache "direct" KV transfer ops as plain torch index copies, for machines without CUDA.

Same names, parameters and semantics as `sgl_kernel.kvcacheio` (sgl-kernel csrc/kvcacheio/transfer.cu), which SGLang
binds only on CUDA/ROCm/XPU. Indices are token slots; `page_size` tokens form a page. Tensor lists are the K layers
followed by the V layers (a single list entry per layer for MLA).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def _check(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"source and destination indices differ in length: {src_indices.numel()} != "
                         f"{dst_indices.numel()}")
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(f"{src_indices.numel()} indices are not a whole number of pages of {page_size}")


def _pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page numbers of the pages that `indices` (page-aligned token slots) start."""
    return indices.reshape(-1, page_size)[:, 0].to(torch.int64) // page_size


def _rows(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of each page: its first index and the page_size - 1 that follow (as the kernel reads them)."""
    starts = indices.reshape(-1, page_size)[:, :1].to(torch.int64)
    return (starts + torch.arange(page_size, device=indices.device)).reshape(-1)


def _per_layer(host: Sequence[torch.Tensor], device: Sequence[torch.Tensor]
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(j, the host tensor of its component, the device tensor of its j-th layer) for every component (K and V, or
    MLA's one) and layer: the device list holds each component's layers in a row, K's then V's."""
    components = len(host)
    if components not in (1, 2) or len(device) % components:
        raise ValueError(f"{len(device)} layer tensors cannot be split into {components} component(s) (K/V or MLA)")
    layers = len(device) // components
    for c, tensor in enumerate(host):
        for j in range(layers):
            yield j, tensor, device[c * layers + j]


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """dst_layers[j][dst_indices[i]] = src_layers[j][src_indices[i]] for every layer tensor j and token i."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layer tensors but {len(dst_layers)} destination ones")
    _check(src_indices, dst_indices, page_size)
    src_idx, dst_idx = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_idx.to(dst.device), src.index_select(0, src_idx.to(src.device)).to(dst.device))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:
    """Host page-first [page, layer, page_size, ...] (one tensor per component) -> device layer-first tensors.

    dst_ptrs holds, per component, the device tensors of layers layer_id, layer_id + 1, ...
    """
    _check(src_indices, dst_indices, page_size)
    pages, rows = _pages(src_indices, page_size), _rows(dst_indices, page_size)
    for j, src, dst in _per_layer(src_ptrs, dst_ptrs):
        # The layer first, then its pages: selecting the pages first would copy every layer of them, once per layer
        # loaded (30x the bytes on SmolLM2: seconds for an 8000-token hit).
        block = src.select(1, layer_id + j).index_select(0, pages.to(src.device))  # [n, page_size, ...]
        dst.index_copy_(0, rows.to(dst.device), block.reshape(-1, *dst.shape[1:]).to(dst.device))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Device layer-first tensors (all layers of each component) -> host page-first [page, layer, page_size, ...]."""
    _check(src_indices, dst_indices, page_size)
    rows, pages = _rows(src_indices, page_size), _pages(dst_indices, page_size)
    for j, dst, src in _per_layer(dst_ptrs, src_ptrs):
        block = src.index_select(0, rows.to(src.device)).reshape(-1, page_size, *src.shape[1:])
        dst.select(1, j).index_copy_(0, pages.to(dst.device), block.to(dst.device))  # writes through the view
