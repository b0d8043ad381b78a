"""A checkpoint's KV cache scales: compressed-tensors' ``kv_cache_scheme`` (what llm-compressor
writes for an FP8 or INT8 KV cache) and the ``k_scale`` / ``v_scale`` tensors beside each
attention layer, read into the scales a quantized cache stores by
(engine/kv_cache/kv_quantization.py).

A checkpoint's scale ``s`` for a cache of type T means a stored element ``q`` stands for
``q * s``, T's largest value standing for ``s * max(T)``: the same rule as ours. Scales saved
for one type serve a cache of the other by that largest magnitude (an fp8 scale s serves an
int8 cache as ``s * 448 / 127``). A checkpoint with ``k_scale``/``v_scale`` and no
``kv_cache_scheme`` (FP8 checkpoints of other tools) holds fp8 scales, as vLLM reads them.
A scale is one per layer (strategy "tensor", every head alike) or one per KV head ("attn_head").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.kv_cache.kv_quantization import QUANTIZED_MAX, KVCacheScales

_FIELD = "quantization_config.kv_cache_scheme"
_STRATEGIES = ("tensor", "attn_head")
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")
_TYPE_OF_KIND = {"float": "fp8_e4m3", "int": "int8"}


@dataclass(frozen=True, slots=True)
class CheckpointKVScheme:
    """What a checkpoint's KV cache scales are for."""

    kind: str  # "float": float8 e4m3 scales; "int": int8 scales
    strategy: str  # "tensor": one scale per layer; "attn_head": one per KV head

    @property
    def kv_cache_dtype(self) -> str:
        """The cache type the scales were made for."""
        return _TYPE_OF_KIND[self.kind]


def parse_kv_cache_scheme(quantization_config: Any) -> CheckpointKVScheme | None:
    """``quantization_config.kv_cache_scheme`` (None when absent); ValueError naming the field
    of anything but static, symmetric 8-bit scales per layer or per head."""
    if not isinstance(quantization_config, dict):
        return None
    raw = quantization_config.get("kv_cache_scheme")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{_FIELD} must be an object, got {raw!r}")
    kind = raw.get("type", "int")
    if kind not in _TYPE_OF_KIND:
        raise ValueError(f"{_FIELD}.type {kind!r} is not supported; only 'float' or 'int'")
    if raw.get("num_bits") != 8:
        raise ValueError(f"{_FIELD}.num_bits {raw.get('num_bits')!r} is not supported; only 8")
    if raw.get("symmetric", True) is not True:
        raise ValueError(f"{_FIELD}.symmetric false is not supported: scales only, no zero point")
    if raw.get("dynamic", False) is not False:
        raise ValueError(
            f"{_FIELD}.dynamic {raw.get('dynamic')!r} is not supported; only static scales"
        )
    strategy = raw.get("strategy", "tensor")
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"{_FIELD}.strategy {strategy!r} is not supported; only 'tensor' (a scale per "
            "layer) or 'attn_head' (a scale per KV head)"
        )
    return CheckpointKVScheme(kind, strategy)


def is_kv_scale(name: str) -> bool:
    """A checkpoint tensor that is a KV cache scale (not a weight of the model)."""
    return _SCALE_NAME.match(name) is not None


def checkpoint_kv_scales(
    files: list[Path],
    scheme: CheckpointKVScheme | None,
    num_layers: int,
    num_kv_heads: int,
    kv_cache_dtype: str,
) -> KVCacheScales | None:
    """The checkpoint's scales (in ``files``) for a ``kv_cache_dtype`` cache, or None when it
    has none; ValueError naming the tensor when some layer's are missing or misshapen."""
    import torch
    from safetensors import safe_open

    found: dict[tuple[int, str], torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                match = _SCALE_NAME.match(name)
                if match is not None:
                    found[(int(match[1]), match[2])] = f.get_tensor(name).float().flatten()
    if not found:
        return None
    made_for = "fp8_e4m3" if scheme is None else scheme.kv_cache_dtype
    factor = QUANTIZED_MAX[made_for] / QUANTIZED_MAX[kv_cache_dtype]
    per_layer = []
    for layer in range(num_layers):
        planes = []
        for plane in ("k", "v"):
            name = f"model.layers.{layer}.self_attn.{plane}_scale"
            scale = found.get((layer, plane))
            if scale is None:
                raise ValueError(f"the checkpoint has KV cache scales but not {name}")
            if scale.numel() not in (1, num_kv_heads):
                raise ValueError(
                    f"{name} has {scale.numel()} values; expected 1 or one per KV head "
                    f"({num_kv_heads})"
                )
            heads = scale.expand(num_kv_heads) * factor
            planes.append(tuple(float(value) for value in heads.tolist()))
        per_layer.append((planes[0], planes[1]))
    return KVCacheScales(kv_cache_dtype, tuple(per_layer))
