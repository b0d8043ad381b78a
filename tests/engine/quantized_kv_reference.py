"""The reference a quantized KV cache is checked against: transformers running the same weights
with its K/V stored and read back by engine/kv_cache/kv_quantization.py's rules."""

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
    layer and head) before attention."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    into = storage_dtype(scales.kv_cache_dtype, torch.float32)
    heads = range(scales.num_kv_heads)

    def stored(states: torch.Tensor, head_scales: torch.Tensor) -> torch.Tensor:
        tokens_major = states.transpose(1, 2)  # [batch, seq, kv_heads, head_dim]
        quantized = quantize_kv(tokens_major, head_scales, into)
        return dequantize_kv(quantized, head_scales, states.dtype).transpose(1, 2)

    tokens = []
    for prompt in prompts:
        cache = DynamicCache(config=model.config)
        for index, layer in enumerate(cache.layers):
            k_scales, v_scales = scales.layer(index, heads, torch.device("cpu"))
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
