"""The reference a quantized KV cache is checked against: transformers running the same weights
with its K/V stored and read back by engine/kv_cache/kv_quantization.py's rules.

A latent-attention model (DeepSeek-V2/V3) caches, in transformers as in the engine, each token's
latent (``kv_a_layernorm`` of the compressed KV) and its rotary key (after the rotary
embedding): its cache layers' ``update(latent, rotary_key)`` gets both quantized by the layer's
one scale, as the engine's latent cache stores a whole entry. (The engine may keep the rotary
key's elements in another order, interleaved or in halves; element-wise quantization by one
shared scale does not see the order.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine.kv_cache.kv_quantization import (
    KVCacheScales,
    dequantize_kv,
    quantize_kv,
    storage_dtype,
)
from tests.engine.quantized_runs import NUM_TOKENS, PROMPTS


def transformers_quantized_kv_greedy(
    model_dir: Path,
    scales: KVCacheScales,
    prompts: list[list[int]] = PROMPTS,
    num_tokens: int = NUM_TOKENS,
) -> list[list[int]]:
    """transformers' greedy ``num_tokens`` after each prompt (eos or not) with every layer's
    new K/V stored as a quantized cache stores them and read back (by the scales of each
    layer and head; a latent cache's latent and rotary key by its layer's one scale) before
    attention."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens = []
    for prompt in prompts:
        cache = quantizing_cache(model.config, scales)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                past_key_values=cache,
            )
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def quantizing_cache(config: Any, scales: KVCacheScales) -> DynamicCache:
    """An empty cache for transformers' model of ``config`` that stores each layer's new K/V
    as a quantized cache stores them, and reads them back (by the scales of each layer and
    head; a latent cache's latent and rotary key by its layer's one scale)."""
    into = storage_dtype(scales.kv_cache_dtype, torch.float32)
    heads = range(scales.num_kv_heads)

    def stored(states: torch.Tensor, head_scales: torch.Tensor) -> torch.Tensor:
        tokens_major = states.transpose(1, 2)  # [batch, seq, kv_heads, head_dim]
        quantized = quantize_kv(tokens_major, head_scales, into)
        return dequantize_kv(quantized, head_scales, states.dtype).transpose(1, 2)

    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        planes = scales.layer(index, heads, torch.device("cpu"))
        # [K, V] scales; a latent cache's one plane scales both halves of its entries
        k_scales, v_scales = planes[0], planes[-1]
        update = layer.update

        def quantized_update(
            key: torch.Tensor,
            value: torch.Tensor,
            *args: Any,
            _update: Any = update,
            _k: torch.Tensor = k_scales,
            _v: torch.Tensor = v_scales,
            **kwargs: Any,
        ) -> Any:
            return _update(stored(key, _k), stored(value, _v), *args, **kwargs)

        layer.update = quantized_update  # type: ignore[method-assign]
    return cache
