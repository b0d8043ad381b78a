"""A paged KV cache stored as a quantized cache stores it (engine/kv_cache/kv_quantization.py),
for the CPU kernels' tests."""

from __future__ import annotations

import torch

from engine.kv_cache.kv_quantization import dequantize_kv, quantize_kv, scales_from_amax

QUANTIZED = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def stored_as(
    cache: torch.Tensor, kv_cache_dtype: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cache`` [2, num_blocks, block_size, num_kv_heads, head_dim] stored as a
    ``kv_cache_dtype`` cache by per-head scales (some heads' from below their largest value, so
    those clamp), the scales [2, num_kv_heads], and what the stored cache stands for
    (float32)."""
    dtype = QUANTIZED[kv_cache_dtype]
    num_kv_heads, head_dim = cache.shape[3:]
    amax = cache.abs().amax(dim=(1, 2, 4))  # [2, num_kv_heads]
    generator = torch.Generator().manual_seed(seed)
    kv_scales = scales_from_amax(
        kv_cache_dtype, amax * (0.3 + torch.rand(2, num_kv_heads, generator=generator))
    )
    planes = [cache[plane].reshape(-1, num_kv_heads, head_dim) for plane in (0, 1)]
    stored = torch.stack([quantize_kv(planes[p], kv_scales[p], dtype) for p in (0, 1)])
    dequantized = torch.stack(
        [dequantize_kv(stored[p], kv_scales[p], torch.float32) for p in (0, 1)]
    )
    return stored.view(cache.shape), kv_scales, dequantized.view(cache.shape)
