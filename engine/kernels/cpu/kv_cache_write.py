"""Scatter new K/V rows into the paged cache on CPU (the C kernel in ``kv_cache_write.c``),
reading them where the qkv projection left them: copied into a float32 or bfloat16 cache,
quantized by the per-head scales into a float8 e4m3 or int8 one (bit for bit as
``quantize_kv``)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels.cpu.build import INT64, POINTER, function
from engine.kernels.cpu.kv_elements import KV_ELEMENT_CODES, check_kv_scales


@functools.cache
def _kernel() -> Any:
    argtypes = [POINTER, POINTER, INT64, POINTER, INT64, POINTER, INT64, POINTER, INT64, INT64]
    argtypes.append(INT64)  # element size
    return function("kv_cache_write", "kv_cache_write_copy", INT64, argtypes)


@functools.cache
def _quantized_kernel() -> Any:
    argtypes = [
        *(POINTER, POINTER, INT64),  # key_cache, value_cache, num_slots
        *(POINTER, INT64, POINTER, INT64),  # key, key_stride, value, value_stride
        *(POINTER, INT64, INT64, INT64),  # slots, num_tokens, num_kv_heads, head_dim
        *(POINTER, INT64),  # scales, element type code
    ]
    return function("kv_cache_write", "kv_cache_write_quantized", INT64, argtypes)


def write_kv_cache_cpu(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], each token's row contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], the same
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is padding, skipped
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] float32: a quantized cache's
) -> None:
    """Writes each token's K and V into its slot: a float32 or bfloat16 cache takes them as
    they are (rows of its own type), a float8_e4m3fn or int8 cache (``kv_scales`` given exactly
    then) float32 rows as ``quantize_kv`` stores them by K's and V's scale per head. ValueError
    naming the argument otherwise."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    check_kv_scales(kv_cache_layer, kv_scales)
    if not kv_cache_layer.is_contiguous() or kv_cache_layer.device.type != "cpu":
        raise ValueError("kv_cache_layer must be a contiguous tensor on the CPU")
    # a quantized cache takes float32 rows, a float one rows of its own type
    row_dtype = torch.float32 if kv_scales is not None else kv_cache_layer.dtype
    for name, rows in (("key", key), ("value", value)):
        if rows.dtype != row_dtype or rows.device.type != "cpu":
            raise ValueError(
                f"{name} must be {_named(row_dtype)} on the CPU (for a "
                f"{_named(kv_cache_layer.dtype)} cache), got {rows.dtype} {rows.device}"
            )
        if rows.shape[1:] != (num_kv_heads, head_dim) or rows.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"{name} must be [{slot_mapping.shape[0]}, {num_kv_heads}, {head_dim}], "
                f"got {tuple(rows.shape)}"
            )
        if rows.stride(2) != 1 or rows.stride(1) != head_dim:
            raise ValueError(f"{name}'s rows must be contiguous, got strides {rows.stride()}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64, got {slot_mapping.dtype}")
    num_slots = num_blocks * block_size
    common = (
        kv_cache_layer[0].data_ptr(),
        kv_cache_layer[1].data_ptr(),
        num_slots,
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        slot_mapping.shape[0],
    )
    if kv_scales is None:
        status = _kernel()(*common, num_kv_heads * head_dim, kv_cache_layer.element_size())
    else:
        code = KV_ELEMENT_CODES[kv_cache_layer.dtype]
        status = _quantized_kernel()(*common, num_kv_heads, head_dim, kv_scales.data_ptr(), code)
    if status != 0:
        token = -status - 1
        raise ValueError(
            f"slot_mapping[{token}] = {int(slot_mapping[token])} is past the cache's "
            f"{num_slots} slots"
        )


def _named(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
