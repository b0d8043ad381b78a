"""Scatter new K/V rows into the paged cache on CPU (the C kernel in ``kv_cache_write.c``),
reading them where the qkv projection left them."""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels.cpu.build import INT64, POINTER, function


@functools.cache
def _kernel() -> Any:
    argtypes = [POINTER, POINTER, INT64, POINTER, INT64, POINTER, INT64, POINTER, INT64, INT64]
    return function("kv_cache_write", "kv_cache_write_f32", INT64, argtypes)


def write_kv_cache_cpu(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] float32
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], each token's row contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], the same
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is padding, skipped
) -> None:
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    token_numel = num_kv_heads * head_dim
    if kv_cache_layer.dtype != torch.float32 or not kv_cache_layer.is_contiguous():
        raise ValueError("kv_cache_layer must be a contiguous float32 tensor")
    for name, rows in (("key", key), ("value", value)):
        if rows.dtype != torch.float32 or rows.device.type != "cpu":
            raise ValueError(f"{name} must be float32 on the CPU, got {rows.dtype} {rows.device}")
        if rows.shape[1:] != (num_kv_heads, head_dim) or rows.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"{name} must be [{slot_mapping.shape[0]}, {num_kv_heads}, {head_dim}], "
                f"got {tuple(rows.shape)}"
            )
        if rows.stride(2) != 1 or rows.stride(1) != head_dim:
            raise ValueError(f"{name}'s rows must be contiguous, got strides {rows.stride()}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64, got {slot_mapping.dtype}")
    status = _kernel()(
        kv_cache_layer[0].data_ptr(),
        kv_cache_layer[1].data_ptr(),
        num_blocks * block_size,
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        slot_mapping.shape[0],
        token_numel,
    )
    if status != 0:
        token = -status - 1
        raise ValueError(
            f"slot_mapping[{token}] = {int(slot_mapping[token])} is past the cache's "
            f"{num_blocks * block_size} slots"
        )
