"""Prefill attention over the paged KV cache on CPU, blocks read in place (the C kernel in
``paged_prefill_attention.c``): each prefill sequence's new tokens attend causally over its
cached prefix and themselves (or the last positions of them a sliding window lets each see),
with no gather of its blocks into a buffer first, nor a dequantized copy of a quantized
cache's."""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels.checks import require
from engine.kernels.cpu.build import INT64, function
from engine.kernels.cpu.paged_kernel_call import (
    check_paged_inputs,
    paged_argtypes,
    run_paged_kernel,
)


@functools.cache
def _kernel() -> Any:
    argtypes = paged_argtypes(2)  # query_start_loc, seq_lens
    return function("paged_prefill_attention", "paged_prefill_attention", INT64, argtypes)


def paged_prefill_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32: the sequences' new tokens
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    # (or a latent cache's [1, num_blocks, block_size, 1, width]: its entries keys and values)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int64 row offsets, from 0 to num_tokens
    seq_lens: torch.Tensor,  # [num_seqs] int64 context lengths (cached + new)
    scale: float,
    num_threads: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    kv_scales: torch.Tensor | None = None,  # [planes, num_kv_heads] float32: a quantized cache's
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float32
    """New token i of sequence s (at position p = seq_lens[s] - query_len + i) attends over
    positions up to its own, their K/V already written: all of them, or with
    ``sliding_window`` W those from p - W + 1 on, the blocks wholly before the first new
    token's window neither read nor checked. ``logit_softcap`` c: each logit ``scale * q . k``
    becomes ``c * tanh(logit / c)``; ``sinks``: head h's logit ``sinks[h]`` joins its softmax's
    denominator. The cache is float32, bfloat16 (read as float32), or float8_e4m3fn / int8 whose
    elements stand for ``element * kv_scales[0 (K) or 1 (V), kv_head]`` (a latent cache's one
    scale both). A latent cache's output rows are weighted sums of whole entries. Work is shared out over
    ``num_threads`` (default: torch's intra-op threads) and the result does not depend on how
    many. ValueError naming the argument for anything the kernel cannot read safely."""
    _check(query, kv_cache_layer, block_tables, query_start_loc, seq_lens, kv_scales)
    out, seq = run_paged_kernel(  # seq: the sequence the kernel refused
        _kernel(),
        "paged_prefill_attention_cpu",
        query,
        kv_cache_layer,
        block_tables,
        (query_start_loc, seq_lens),
        seq_lens.shape[0],
        scale,
        num_threads,
        sliding_window,
        logit_softcap,
        sinks,
        kv_scales,
    )
    if seq is not None:
        query_len = int(query_start_loc[seq + 1] - query_start_loc[seq])
        raise ValueError(
            f"sequence {seq}: its {query_len} new tokens (query_start_loc) must be >= 1 and "
            f"<= seq_lens[{seq}] = {int(seq_lens[seq])}, which must be <= "
            f"{block_tables.shape[1] * kv_cache_layer.shape[2]} (block_tables' capacity), and "
            f"its block_tables entries in [0, {kv_cache_layer.shape[1]})"
            + ("" if sliding_window is None else " from the first block its window reaches")
        )
    return out


def _check(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_scales: torch.Tensor | None,
) -> None:
    require(seq_lens.dim() == 1 and seq_lens.is_contiguous(), "seq_lens must be a contiguous 1-D")
    num_seqs = seq_lens.shape[0]
    check_paged_inputs(
        query,
        kv_cache_layer,
        block_tables,
        num_seqs,
        kv_scales,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    require(
        query_start_loc.shape == (num_seqs + 1,) and query_start_loc.is_contiguous(),
        f"query_start_loc must be a contiguous [{num_seqs + 1}], "
        f"got {tuple(query_start_loc.shape)}",
    )
    if num_seqs:
        num_tokens = query.shape[0]
        require(
            int(query_start_loc[0]) == 0 and int(query_start_loc[-1]) == num_tokens,
            f"query_start_loc must run from 0 to query's {num_tokens} rows, got "
            f"{int(query_start_loc[0])} to {int(query_start_loc[-1])}",
        )
