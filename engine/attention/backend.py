"""The attention-backend interface: every implementation (torch reference, Triton) fits it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.attention import latent_ref
from engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class DecodeSizing:
    """What an engine fixes about its decode steps, for a backend that sizes its work by them:
    the longest context, and the batch sizes (rows: a token each, drafts included) decode
    steps are padded to in CUDA graphs. An eager step is sized as its graph would be, so the
    two compute the same bits."""

    max_context: int  # max_model_len
    batch_sizes: tuple[int, ...]  # sorted; a step of more rows is sized by its own count


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def write_kv(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> None:
        """Scatter the new tokens' K/V into their cache slots; into a quantized cache (float8
        e4m3 or int8 elements) as engine/kv_cache/kv_quantization.py stores them, by this
        layer's K and V scale per head (``kv_scales``, given exactly when the cache is
        quantized)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each new token over its sequence's context in the paged cache.
        A quantized cache's elements are read as what they stand for (``element * scale``,
        with ``kv_scales`` as in ``write_kv``).

        ``sliding_window`` W: a token at position p sees only positions p - W + 1 .. p (None:
        its whole context); a backend then never reads a block wholly before every window
        of a sequence's new tokens, whose block-table entries may be stale.
        ``logit_softcap`` c (Gemma 2): each logit ``scale * q . k`` becomes ``c * tanh(logit /
        c)`` before the softmax. ``sinks`` (gpt-oss): head h's learned logit ``sinks[h]`` joins
        its softmax's denominator (as a position with no value), so a head may attend to
        nothing: ``p_j = exp(l_j) / (exp(sinks[h]) + sum_i exp(l_i))``."""

    # Latent caches (multi-head latent attention): one plane per layer, one entry per token.
    # The torch reference serves every backend until one brings its own kernels.

    def write_latent(
        self,
        cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
        entries: torch.Tensor,  # [num_tokens, width]: each token's latent, then its rotary key
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
    ) -> None:
        """Scatter the new tokens' latent entries into their cache slots; into a quantized
        cache as engine/kv_cache/kv_quantization.py stores them, by the layer's one scale
        (``kv_scales``, given exactly when the cache is quantized)."""
        latent_ref.write_latent(cache_layer, entries, slot_mapping, kv_scales)

    def forward_latent(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, width]: absorbed into the latent space
        cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
        metadata: AttentionMetadata,
        scale: float,
        value_dim: int,  # the entries' first value_dim elements are the values (the latent)
        kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_tokens, num_heads, value_dim]
        """Causal attention of each new token over its sequence's latent entries, as MQA with
        one KV head whose keys are the whole entries and values their first elements. A
        quantized cache's elements are read as what they stand for (``element * scale``)."""
        return latent_ref.latent_attention(
            query, cache_layer, metadata, scale, value_dim, kv_scales=kv_scales
        )
