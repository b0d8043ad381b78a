"""Rotary position embeddings (rotate-half convention, as Hugging Face Llama/Mistral/Qwen).

Inverse frequencies follow transformers' ``modeling_rope_utils`` step by step in float32, so
the cached cos/sin tables are bit-identical to the ones Hugging Face computes per forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] fp32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "default":
        return inv_freq
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(f"unsupported rope scaling type {rope.scaling_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by factor, short kept, middle interpolated."""
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for every position up to the model's max length, built once."""

    cos_sin_cache: torch.Tensor  # [max_positions, head_dim] fp32: cos half then sin half

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer("cos_sin_cache", self._build_cache(None), persistent=False)

    def _build_cache(self, device: torch.device | None) -> torch.Tensor:
        inv_freq = compute_inv_freq(self.rope, self.head_dim)  # [head_dim // 2]
        if device is not None:
            inv_freq = inv_freq.to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def reset_cache(self) -> None:
        """Recompute the table in fp32 on the buffer's device (after meta-device construction)."""
        self.cos_sin_cache = self._build_cache(self.cos_sin_cache.device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2] each
        """Look up the tables once per forward; every layer then calls apply_rotary."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype)  # [num_tokens, head_dim]
        cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)
        return cos, sin


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Rotate-half rope; the same elementwise ops as transformers' apply_rotary_pos_emb."""
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, num_heads, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
