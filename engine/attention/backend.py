"""The attention-backend interface: every implementation (torch reference, Triton) fits it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def write_kv(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Scatter the new tokens' K/V into their cache slots."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each new token over its sequence's context in the paged cache."""
