"""Decode attention over the paged KV cache on CPU, blocks read in place (the C kernel in
``paged_decode_attention.c``): no gather of each sequence's blocks into a buffer first."""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels.checks import require
from engine.kernels.cpu.build import FLOAT, INT64, POINTER, function
from engine.kernels.cpu.paged_inputs import check_paged_inputs


@functools.cache
def _kernel() -> Any:
    argtypes = [
        *(POINTER,) * 4,  # query, key, value, block_tables
        INT64,  # table_stride
        POINTER,  # seq_lens
        POINTER,  # out
        *(INT64,) * 6,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks
        FLOAT,  # scale
        INT64,  # num_threads
    ]
    return function("paged_decode_attention", "paged_decode_attention_f32", INT64, argtypes)


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] float32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, each in [1, max_blocks * block_size]
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One new token per sequence attends over its whole context (the new token's K/V already
    written), the sequences shared out over ``num_threads`` (default: torch's intra-op
    threads); the result does not depend on how many. ValueError naming the argument for
    anything the kernel cannot read safely."""
    if num_threads is None:
        num_threads = torch.get_num_threads()
    require(num_threads >= 1, f"num_threads must be >= 1, got {num_threads}")
    _check(query, kv_cache_layer, block_tables, seq_lens)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    num_seqs, num_heads, _ = query.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    status = _kernel()(
        query.data_ptr(),
        kv_cache_layer[0].data_ptr(),
        kv_cache_layer[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        scale,
        num_threads,
    )
    if status == -(1 + num_seqs):
        raise MemoryError("paged_decode_attention_cpu: out of memory for its scratch buffers")
    if status != 0:
        seq = -status - 1
        raise ValueError(
            f"sequence {seq}: seq_lens[{seq}] = {int(seq_lens[seq])} must be in "
            f"[1, {block_tables.shape[1] * block_size}] (block_tables' capacity), and its "
            f"block_tables entries in [0, {num_blocks})"
        )
    return out


def _check(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    check_paged_inputs(query, kv_cache_layer, block_tables, None, seq_lens=seq_lens)
    num_seqs = query.shape[0]
    require(
        seq_lens.shape == (num_seqs,) and seq_lens.is_contiguous(),
        f"seq_lens must be a contiguous [{num_seqs}], got {tuple(seq_lens.shape)}",
    )
