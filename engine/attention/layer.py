"""The attention modules models call: store new K/V (or latent entries) in the paged cache, then
attend over it.

Which cache, which batch layout and which kernels come from the forward context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context
from engine.kv_cache.cache_groups import LayerPlace
from engine.kv_cache.kv_quantization import KVCacheScales


class Attention(nn.Module):
    def __init__(
        self,
        place: LayerPlace,  # its cache group and slot (engine/kv_cache/cache_groups.py)
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,  # a token sees this many positions, itself included
        logit_softcap: float | None = None,  # logits become c * tanh(logit / c) (Gemma 2)
        num_sinks: int = 0,  # num_heads: a learned sink logit per head (gpt-oss); 0: none
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")
        self.place = place
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # each head's sink logit, in the softmax's denominator (AttentionBackend.forward)
        self.sinks: nn.Parameter | None = None
        if num_sinks:
            if num_sinks != num_heads:
                raise ValueError(f"{num_sinks=} must equal {num_heads=}: one sink per head")
            self.sinks = nn.Parameter(torch.empty(num_heads))
        # [2, num_kv_heads] fp32: this layer's K and V scale per head when the KV cache is
        # quantized (engine/kv_cache/kv_quantization.py), set with the cache; None otherwise
        self.kv_scales: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] (rows as many as the query's)
        context = get_forward_context()
        kv_cache_layer = context.kv_cache[self.place.slot]  # [2, blocks, block_size, kvh, head_dim]
        backend = context.attn_backend
        metadata = context.group_metadata(self.place.group)
        # rows past the batch's tokens are padding (ForwardInputs.num_padding_rows): no K/V is
        # written for them, and their output is zeros
        num_tokens = metadata.num_tokens
        num_padding = query.shape[0] - num_tokens
        if num_padding > 0:
            query, key, value = query[:num_tokens], key[:num_tokens], value[:num_tokens]
        kv_scales = self.kv_scales
        backend.write_kv(kv_cache_layer, key, value, metadata.slot_mapping, kv_scales)
        sinks = None if self.sinks is None else self.sinks.float()
        out = backend.forward(
            query,
            kv_cache_layer,
            metadata,
            self.scale,
            self.sliding_window,
            logit_softcap=self.logit_softcap,
            sinks=sinks,
            kv_scales=kv_scales,
        )
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return F.pad(out, (0, 0, 0, num_padding)) if num_padding > 0 else out


class LatentCacheAttention(nn.Module):
    """Attention over a latent KV cache (multi-head latent attention): stores the new tokens'
    entries, then attends with queries already absorbed into the latent space."""

    num_kv_heads = 1  # every query head reads the one latent entry per token

    def __init__(self, place: LayerPlace, num_heads: int, scale: float, value_dim: int) -> None:
        super().__init__()
        self.place = place
        self.num_heads = num_heads
        self.scale = scale
        self.value_dim = value_dim
        # [1, 1] fp32: the layer's one scale for its whole entries when the cache is quantized
        # (engine/kv_cache/kv_quantization.py), set with the cache; None otherwise
        self.kv_scales: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,  # [rows, num_heads, width]
        entries: torch.Tensor,  # [rows, width]: each token's latent, then its rotary key
    ) -> torch.Tensor:  # [rows, num_heads, value_dim]
        context = get_forward_context()
        cache_layer = context.kv_cache[self.place.slot]  # [1, blocks, block_size, 1, width]
        backend = context.attn_backend
        metadata = context.group_metadata(self.place.group)
        # rows past the batch's tokens are padding: no entry is written, their output is zeros
        num_tokens = metadata.num_tokens
        num_padding = query.shape[0] - num_tokens
        if num_padding > 0:
            query, entries = query[:num_tokens], entries[:num_tokens]
        kv_scales = self.kv_scales
        backend.write_latent(cache_layer, entries, metadata.slot_mapping, kv_scales)
        out = backend.forward_latent(
            query, cache_layer, metadata, self.scale, self.value_dim, kv_scales=kv_scales
        )
        return F.pad(out, (0, 0, 0, 0, 0, num_padding)) if num_padding > 0 else out


def set_kv_scales(
    model: nn.Module, scales: KVCacheScales, kv_heads: range, device: torch.device
) -> None:
    """Give every attention layer of ``model`` its share of a quantized cache's scales: those
    of the model's KV ``heads`` its cache holds (a tensor-parallel rank's; a latent cache's one
    head on every rank)."""
    for module in model.modules():
        if isinstance(module, (Attention, LatentCacheAttention)):
            module.kv_scales = scales.layer(module.place.layer, kv_heads, device)
