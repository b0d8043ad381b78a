"""The KV cache element types the CPU kernels read and write (float32, and the quantized float8
e4m3 and int8 of engine/kv_cache/kv_quantization.py), their codes in C (``kv_elements.h``), and
the check of a quantized cache's scales."""

from __future__ import annotations

import torch

from engine.kernels.checks import require

# the codes of kv_elements.h
KV_ELEMENT_CODES = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.int8: 2}
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


def check_kv_scales(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_scales: torch.Tensor | None,  # [2, num_kv_heads] float32
) -> None:
    """Refuses, naming the argument, a cache of a type the kernels do not take, and
    ``kv_scales`` unless they come exactly with a quantized cache as a contiguous float32
    [2, num_kv_heads] on the CPU (K's scale per KV head, then V's)."""
    dtype = kv_cache_layer.dtype
    require(
        dtype in KV_ELEMENT_CODES,
        f"kv_cache_layer must be float32, float8_e4m3fn or int8, got {dtype}",
    )
    if dtype not in QUANTIZED_DTYPES:
        require(kv_scales is None, f"kv_scales are for a quantized cache, this one is {dtype}")
        return
    num_kv_heads = kv_cache_layer.shape[3]
    if kv_scales is None:
        raise ValueError(f"a {dtype} cache needs kv_scales")
    require(
        kv_scales.shape == (2, num_kv_heads) and kv_scales.is_contiguous(),
        f"kv_scales must be a contiguous [2, num_kv_heads = {num_kv_heads}], "
        f"got {tuple(kv_scales.shape)}",
    )
    require(kv_scales.dtype == torch.float32, f"kv_scales must be float32, got {kv_scales.dtype}")
    require(kv_scales.device.type == "cpu", f"kv_scales must be on the CPU, got {kv_scales.device}")
