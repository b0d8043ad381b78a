"""Argument checks shared by the kernel wrappers (Triton, and the CPU decode kernel); every
failure names the argument."""

from __future__ import annotations

import math

import torch
import triton

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# a quantized KV cache's elements (engine/kv_cache/kv_quantization.py): Triton's float8e4nv, int8
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
LOG2_E = 1.4426950408889634  # kernels run the softmax in base 2: exp(x) = exp2(x * LOG2_E)


def interpreted() -> bool:
    """Kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before import)."""
    return bool(triton.knobs.runtime.interpret)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_power_of_two(name: str, value: int, least: int) -> None:
    require(
        value >= least and value & (value - 1) == 0,
        f"{name} must be a power of two >= {least}, got {value}",
    )


def require_softcap(logit_softcap: float | None) -> None:
    """A logit soft-cap ``c`` (logits become ``c * tanh(logit / c)``): positive and finite."""
    require(
        logit_softcap is None or (logit_softcap > 0 and math.isfinite(logit_softcap)),
        f"logit_softcap must be > 0 and finite, or None, got {logit_softcap}",
    )


def require_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Attention sinks: one float32 logit per query head, on the query's device."""
    if sinks is None:
        return
    num_heads = query.shape[1]
    require(
        sinks.shape == (num_heads,) and sinks.is_contiguous(),
        f"sinks must be a contiguous [num_heads = {num_heads}], got {tuple(sinks.shape)}",
    )
    require(sinks.dtype == torch.float32, f"sinks must be float32, got {sinks.dtype}")
    require(sinks.device == query.device, f"sinks is on {sinks.device}, query on {query.device}")


def require_contiguous_heads(name: str, tensor: torch.Tensor) -> None:
    """``tensor`` is [num_tokens, num_heads, head_dim] with each token's heads side by side
    (a view into a fused qkv projection's rows passes; its token stride is free)."""
    head_dim = tensor.shape[2]
    require(
        tensor.stride(2) == 1 and tensor.stride(1) == head_dim,
        f"{name}'s heads must be contiguous, got strides {tensor.stride()}",
    )


def require_kv_cache_layer(kv_cache_layer: torch.Tensor) -> None:
    """One layer's paged cache as every kernel reads it: [2, num_blocks, block_size,
    num_kv_heads, head_dim], contiguous, of a float dtype the kernels take or a quantized one."""
    require(
        kv_cache_layer.dim() == 5 and kv_cache_layer.shape[0] == 2,
        "kv_cache_layer must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(kv_cache_layer.shape)}",
    )
    require(kv_cache_layer.is_contiguous(), "kv_cache_layer must be contiguous")
    require(
        kv_cache_layer.dtype in FLOAT_DTYPES + QUANTIZED_KV_DTYPES,
        "kv_cache_layer dtype must be float32, float16, bfloat16, float8_e4m3fn or int8, got "
        f"{kv_cache_layer.dtype}",
    )


def is_quantized_cache(kv_cache_layer: torch.Tensor) -> bool:
    return kv_cache_layer.dtype in QUANTIZED_KV_DTYPES


def require_kv_scales(kv_scales: torch.Tensor | None, kv_cache_layer: torch.Tensor) -> None:
    """A quantized cache's scales, given exactly when the cache is quantized: a contiguous
    float32 [planes, num_kv_heads] on the cache's device, where the cache layer is [planes,
    num_blocks, block_size, num_kv_heads, head_dim]: row 0 the keys', row 1 the values' (2
    planes), or a latent cache's one scale ([1, 1])."""
    if not is_quantized_cache(kv_cache_layer):
        require(
            kv_scales is None,
            f"kv_scales are for a quantized cache; kv_cache_layer is {kv_cache_layer.dtype}",
        )
        return
    planes = kv_cache_layer.shape[0]
    if kv_scales is None:
        what = "its K and V scale per head" if planes == 2 else "its one scale"
        raise ValueError(f"a {kv_cache_layer.dtype} kv_cache_layer needs kv_scales ({what})")
    num_kv_heads = kv_cache_layer.shape[3]
    require(
        kv_scales.shape == (planes, num_kv_heads) and kv_scales.is_contiguous(),
        f"kv_scales must be a contiguous [{planes}, num_kv_heads = {num_kv_heads}], got "
        f"{tuple(kv_scales.shape)}",
    )
    require(kv_scales.dtype == torch.float32, f"kv_scales must be float32, got {kv_scales.dtype}")
    require(
        kv_scales.device == kv_cache_layer.device,
        f"kv_scales is on {kv_scales.device}, kv_cache_layer on {kv_cache_layer.device}",
    )


def require_bias(bias: torch.Tensor, out_features: int) -> None:
    """A matmul's bias: a contiguous float [out_features]."""
    require(
        tuple(bias.shape) == (out_features,)
        and bias.is_contiguous()
        and bias.dtype in FLOAT_DTYPES,
        f"bias must be a contiguous float [out_features = {out_features}], got "
        f"{list(bias.shape)} {bias.dtype}",
    )


def require_same_device(
    anchor: torch.Tensor, anchor_name: str = "kv_cache_layer", **tensors: torch.Tensor
) -> None:
    """Every tensor on ``anchor``'s device, and that device one Triton can run on."""
    for name, tensor in tensors.items():
        require(
            tensor.device == anchor.device,
            f"{name} is on {tensor.device}, {anchor_name} on {anchor.device}",
        )
    require(
        anchor.device.type != "cpu" or interpreted(),
        "Triton kernels need a GPU; CPU tensors only run with TRITON_INTERPRET=1",
    )


def require_prefill_index_tensors(
    query: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    cache_name: str,
) -> None:
    """A varlen prefill's index tensors: integer dtypes, the strides the kernels read, and
    every tensor on the cache's device."""
    for name, index in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        require(index.dtype in INDEX_DTYPES, f"{name} must be int32/int64, got {index.dtype}")
    require(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    require(block_tables.stride(-1) == 1, "block_tables must be contiguous in each row")
    require_same_device(
        cache,
        cache_name,
        query=query,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
    )


def require_prefill_offsets(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
) -> None:
    """A varlen prefill's index tensors: their shapes, and (on CPU, where reading them costs no
    sync) their values against query's rows and the block tables."""
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    require(seq_lens.dim() == 1, f"seq_lens must be [num_seqs], got {tuple(seq_lens.shape)}")
    require(
        query_start_loc.shape == (num_seqs + 1,),
        f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], got {tuple(query_start_loc.shape)}",
    )
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}",
    )
    if query.device.type != "cpu":
        return  # reading the values would sync the GPU on every layer of every step
    starts: list[int] = query_start_loc.tolist()
    lens: list[int] = seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    require(
        starts[0] == 0 and starts[-1] == query.shape[0] and min(query_lens, default=0) >= 0,
        f"query_start_loc must rise from 0 to query's {query.shape[0]} rows, got {starts}",
    )
    require(
        max_query_len >= max(query_lens, default=0),
        f"max_query_len {max_query_len} is below the longest query {max(query_lens, default=0)}",
    )
    require(
        all(q_len <= seq_len for q_len, seq_len in zip(query_lens, lens)),
        f"seq_lens {lens} must be >= each seq's query length {query_lens}",
    )
    block_size = kv_cache_layer.shape[2]
    needed = -(-max(lens, default=0) // block_size)
    require(
        block_tables.shape[1] >= needed,
        f"block_tables has {block_tables.shape[1]} columns, seq_lens need {needed}",
    )
