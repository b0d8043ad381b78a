"""The attention module models call: stores new K/V in the paged cache, then attends over it.

Which cache, which batch layout and which kernels come from the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        context = get_forward_context()
        kv_cache_layer = context.kv_cache[self.layer_idx]  # [2, blocks, block_size, kvh, head_dim]
        backend = context.attn_backend
        backend.write_kv(kv_cache_layer, key, value, context.attn_metadata.slot_mapping)
        out = backend.forward(query, kv_cache_layer, context.attn_metadata, self.scale)
        return out.reshape(query.shape[0], self.num_heads * self.head_dim)
