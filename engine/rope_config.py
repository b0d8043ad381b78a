"""A model's rotary position embedding, parsed from its config.json: the base, the scaling type
and its parameters (linear, llama3, longrope, yarn), and Gemma 3's two ropes. Both the classic
keys (``rope_theta`` + ``rope_scaling``) and the transformers-v5 ``rope_parameters`` dict are
accepted. engine/models/rope.py turns a ``RopeConfig`` into frequencies."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float  # base of the inverse frequencies
    scaling_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float  # linear / llama3 scaling factor (1.0 for "default")
    low_freq_factor: float  # llama3 only
    high_freq_factor: float  # llama3 only
    original_max_position_embeddings: int  # llama3, longrope: pre-training context length
    # longrope (Phi-3): per-frequency divisors for sequences within the pre-training length and
    # past it, and the scale of cos and sin (empty and 1.0 for the other types)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # longrope and yarn: the scale of cos and sin (1.0 for the other types)
    attention_factor: float = 1.0
    # yarn: the rotations per context that bound the interpolated and extrapolated
    # frequencies, and whether those bounds are rounded outwards
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context grown ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_rope(raw: dict[str, Any], max_positions: int, default_theta: float) -> RopeConfig:
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {params}")
    scaling_type = str(params.get("rope_type", params.get("type", "default")))
    if scaling_type == "su":  # Phi-3's early name for it
        scaling_type = "longrope"
    if scaling_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {scaling_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    factor = params.get("factor", 1.0) if scaling_type != "default" else 1.0
    original_max = int(
        params.get(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", max_positions),
        )
    )
    rope = RopeConfig(
        theta=float(theta),
        scaling_type=scaling_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original_max,
    )
    if scaling_type == "longrope":
        return _longrope(rope, params, max_positions)
    if scaling_type == "yarn":
        return _yarn(rope, params, max_positions)
    return rope


def gemma3_ropes(raw: dict[str, Any], max_positions: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's two ropes: the global layers' (base 1e6 and any scaling) and the sliding
    layers' (base 10000, unscaled), from transformers-v5 ``rope_parameters`` per layer type or
    the older ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(raw.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", raw.get("rope_theta", 1e6))
        local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", 1e6)
    local.setdefault("rope_theta", 10000.0)
    outside = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    return (
        parse_rope({**outside, "rope_parameters": full}, max_positions, 1e6),
        parse_rope({**outside, "rope_parameters": local}, max_positions, 10000.0),
    )


def _yarn(rope: RopeConfig, params: dict[str, Any], max_positions: int) -> RopeConfig:
    """YaRN's ramp bounds and its cos/sin scale as transformers derives them: from
    ``attention_factor``, else from ``mscale`` over ``mscale_all_dim`` (DeepSeek), else from
    the context's growth alone."""
    factor = params.get("factor")
    growth = float(factor) if factor else max_positions / rope.original_max_position_embeddings
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(growth, float(mscale)) / yarn_mscale(
                growth, float(mscale_all_dim)
            )
        else:
            attention_factor = yarn_mscale(growth)
    return dataclasses.replace(
        rope,
        factor=growth,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )


def _longrope(rope: RopeConfig, params: dict[str, Any], max_positions: int) -> RopeConfig:
    """LongRoPE's factors, and its cos/sin scale as transformers derives it: from
    ``attention_factor``, else from the context's growth (``factor``, else max positions over
    the pre-training length)."""
    short, long = params.get("short_factor"), params.get("long_factor")
    if not isinstance(short, list) or not isinstance(long, list):
        raise ValueError("rope type 'longrope' needs the lists short_factor and long_factor")
    factor = params.get("factor")
    growth = float(factor) if factor else max_positions / rope.original_max_position_embeddings
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0
            if growth <= 1.0
            else math.sqrt(1 + math.log(growth) / math.log(rope.original_max_position_embeddings))
        )
    return dataclasses.replace(
        rope,
        factor=growth,
        short_factor=tuple(float(f) for f in short),
        long_factor=tuple(float(f) for f in long),
        attention_factor=float(attention_factor),
    )
