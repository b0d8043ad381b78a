"""What the CPU paged-attention kernels (prefill and decode) share around their C calls: the
argument checks both need to read the query, the cache (float32, bfloat16, or float8 e4m3 /
int8 with its scales) and the block tables safely (failures name the argument), their ctypes
signature, and the call itself (with its sliding window, logit soft-cap, attention sinks and a
quantized cache's scales).

A latent cache (multi-head latent attention) is one plane, ``[1, num_blocks, block_size, 1,
width]``: the kernels read its entries as both the keys and the values (one KV head every query
head shares), so each output row is the weighted sum of whole entries, of which the caller keeps
the latent part; its one scale serves as the keys' and the values'."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.kernels.checks import require, require_sinks, require_softcap
from engine.kernels.cpu.build import FLOAT, INT64, POINTER
from engine.kernels.cpu.kv_elements import KV_ELEMENT_CODES, check_kv_scales


def check_paged_inputs(
    query: torch.Tensor,  # [rows, num_heads, head_dim] float32
    kv_cache_layer: torch.Tensor,  # [planes, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    num_seqs: int | None,  # None: one per query row (decode)
    kv_scales: torch.Tensor | None,  # [planes, num_kv_heads] float32: a quantized cache's
    **indices: torch.Tensor,  # further int64 tensors by name (seq_lens, query_start_loc)
) -> None:
    """Refuses, naming the argument, what the kernels cannot read safely; the cache may be
    float32, bfloat16, or float8_e4m3fn / int8 with ``kv_scales`` (given exactly then); its
    planes K and V, or a latent cache's one."""
    tensors = {"query": query, "kv_cache_layer": kv_cache_layer, "block_tables": block_tables}
    for name, tensor in {**tensors, **indices}.items():
        require(tensor.device.type == "cpu", f"{name} must be on the CPU, got {tensor.device}")
    require(query.dtype == torch.float32, f"query must be float32, got {query.dtype}")
    for name, tensor in (("query", query), ("kv_cache_layer", kv_cache_layer)):
        require(tensor.is_contiguous(), f"{name} must be contiguous")
    for name, tensor in {"block_tables": block_tables, **indices}.items():
        require(tensor.dtype == torch.int64, f"{name} must be int64, got {tensor.dtype}")
    require(
        kv_cache_layer.dim() == 5
        and (
            kv_cache_layer.shape[0] == 2 or kv_cache_layer.shape[0] == kv_cache_layer.shape[3] == 1
        ),
        "kv_cache_layer must be [2, num_blocks, block_size, num_kv_heads, head_dim] (or a "
        f"latent cache's [1, num_blocks, block_size, 1, width]), got {tuple(kv_cache_layer.shape)}",
    )
    check_kv_scales(kv_cache_layer, kv_scales)
    require(query.dim() == 3, f"query must be [rows, num_heads, head_dim], got {query.dim()}-D")
    num_rows, num_heads, head_dim = query.shape
    num_seqs = num_rows if num_seqs is None else num_seqs
    num_kv_heads = kv_cache_layer.shape[3]
    require(
        head_dim == kv_cache_layer.shape[4],
        f"query head_dim {head_dim} != kv_cache_layer head_dim {kv_cache_layer.shape[4]}",
    )
    require(
        num_heads % num_kv_heads == 0,
        f"query's {num_heads} heads must be a multiple of the cache's {num_kv_heads} KV heads",
    )
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}",
    )
    require(
        block_tables.shape[1] == 0 or block_tables.stride(1) == 1,
        "block_tables' rows must be contiguous",
    )


def paged_argtypes(num_indices: int) -> list[Any]:
    """The C signature: query, key, value, block_tables, table_stride, ``num_indices`` int64
    arrays, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
    sliding_window (0: none), scale, logit_softcap (0: none), sinks (NULL: none), the cache's
    element type (kv_elements.h's code), kv_scales (NULL: a float32 cache), num_threads."""
    return [
        *(POINTER,) * 4,
        INT64,
        *(POINTER,) * num_indices,
        POINTER,
        *(INT64,) * 7,
        FLOAT,
        FLOAT,
        POINTER,
        INT64,
        POINTER,
        INT64,
    ]


def run_paged_kernel(
    kernel: Any,
    name: str,
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    indices: Sequence[torch.Tensor],
    num_seqs: int,
    scale: float,
    num_threads: int | None,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,  # [num_heads] float32
    kv_scales: torch.Tensor | None,  # [planes, num_kv_heads] float32: a quantized cache's
) -> tuple[torch.Tensor, int | None]:
    """Run a checked call of ``kernel`` (signed as ``paged_argtypes``) on ``num_threads``
    (default: torch's intra-op threads), each query seeing its last ``sliding_window``
    positions (None: all), its logits soft-capped at ``logit_softcap`` (None: not) and its
    head's sink logit in the softmax's denominator (``sinks`` None: none), a quantized cache's
    elements read as ``element * kv_scales[plane, head]``. Returns the output and the
    sequence the kernel refused (None: it ran them all), for the caller to word; MemoryError
    when its scratch ran out."""
    if num_threads is None:
        num_threads = torch.get_num_threads()
    require(num_threads >= 1, f"num_threads must be >= 1, got {num_threads}")
    require(
        sliding_window is None or sliding_window >= 1,
        f"sliding_window must be None or >= 1, got {sliding_window}",
    )
    require_softcap(logit_softcap)
    require_sinks(sinks, query)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out, None
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    if kv_scales is not None and kv_scales.shape[0] == 1:  # a latent cache's: K's and V's
        kv_scales = kv_scales.expand(2, -1).contiguous()
    status = kernel(
        query.data_ptr(),
        kv_cache_layer[0].data_ptr(),
        kv_cache_layer[-1].data_ptr(),  # a latent cache's one plane is its values too
        block_tables.data_ptr(),
        block_tables.stride(0),
        *(index.data_ptr() for index in indices),
        out.data_ptr(),
        num_seqs,
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        sliding_window or 0,
        scale,
        logit_softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        KV_ELEMENT_CODES[kv_cache_layer.dtype],
        None if kv_scales is None else kv_scales.data_ptr(),
        num_threads,
    )
    if status == -(1 + num_seqs):
        raise MemoryError(f"{name}: out of memory for its scratch buffers")
    return out, None if status == 0 else -status - 1
