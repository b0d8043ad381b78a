"""Decode attention over the paged KV cache on CPU, blocks read in place (the C kernel in
``paged_decode_attention.c``): no gather of each sequence's blocks into a buffer first, nor a
dequantized copy of a quantized cache's."""

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
    argtypes = paged_argtypes(1)  # seq_lens
    return function("paged_decode_attention", "paged_decode_attention", INT64, argtypes)


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    # (or a latent cache's [1, num_blocks, block_size, 1, width]: its entries keys and values)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, each in [1, max_blocks * block_size]
    scale: float,
    num_threads: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    kv_scales: torch.Tensor | None = None,  # [planes, num_kv_heads] float32: a quantized cache's
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] float32
    """One new token per sequence attends over its context (the new token's K/V already
    written): all of it, or with ``sliding_window`` W its last W positions, the blocks wholly
    before them neither read nor checked. ``logit_softcap`` c: each logit ``scale * q . k``
    becomes ``c * tanh(logit / c)``; ``sinks``: head h's logit ``sinks[h]`` joins its softmax's
    denominator. The cache is float32, bfloat16 (read as float32), or float8_e4m3fn / int8 whose
    elements stand for ``element * kv_scales[0 (K) or 1 (V), kv_head]`` (a latent cache's one
    scale both). A latent cache's output rows are weighted sums of whole entries. The sequences are shared out over
    ``num_threads`` (default: torch's intra-op threads); the result does not depend on how
    many. ValueError naming the argument for anything the kernel cannot read safely."""
    _check(query, kv_cache_layer, block_tables, seq_lens, kv_scales)
    out, seq = run_paged_kernel(  # seq: the sequence the kernel refused
        _kernel(),
        "paged_decode_attention_cpu",
        query,
        kv_cache_layer,
        block_tables,
        (seq_lens,),
        query.shape[0],
        scale,
        num_threads,
        sliding_window,
        logit_softcap,
        sinks,
        kv_scales,
    )
    if seq is not None:
        raise ValueError(
            f"sequence {seq}: seq_lens[{seq}] = {int(seq_lens[seq])} must be in "
            f"[1, {block_tables.shape[1] * kv_cache_layer.shape[2]}] (block_tables' capacity), "
            f"and its block_tables entries in [0, {kv_cache_layer.shape[1]})"
            + ("" if sliding_window is None else " from the first block its window reaches")
        )
    return out


def _check(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_scales: torch.Tensor | None,
) -> None:
    check_paged_inputs(query, kv_cache_layer, block_tables, None, kv_scales, seq_lens=seq_lens)
    num_seqs = query.shape[0]
    require(
        seq_lens.shape == (num_seqs,) and seq_lens.is_contiguous(),
        f"seq_lens must be a contiguous [{num_seqs}], got {tuple(seq_lens.shape)}",
    )
