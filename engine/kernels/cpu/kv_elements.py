"""The KV cache element types the CPU kernels read and write (float32, bfloat16, and the
quantized float8 e4m3 and int8 of engine/kv_cache/kv_quantization.py), their codes in C
(``kv_elements.h``), and the check of a quantized cache's scales."""

from __future__ import annotations

import torch

from engine.kernels.checks import require, require_kv_scales

# the codes of kv_elements.h
KV_ELEMENT_CODES = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.int8: 2, torch.bfloat16: 3}


def check_kv_scales(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_scales: torch.Tensor | None,  # [2, num_kv_heads] float32
) -> None:
    """Refuses, naming the argument, a cache of a type the kernels do not take, and
    ``kv_scales`` unless they come exactly with a quantized cache (``require_kv_scales``)."""
    dtype = kv_cache_layer.dtype
    require(
        dtype in KV_ELEMENT_CODES,
        f"kv_cache_layer must be float32, bfloat16, float8_e4m3fn or int8, got {dtype}",
    )
    require_kv_scales(kv_scales, kv_cache_layer)
