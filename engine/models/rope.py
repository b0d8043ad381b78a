"""Rotary position embeddings (rotate-half convention, as Hugging Face Llama/Mistral/Qwen/Phi-3;
DeepSeek's interleaved pairs are reordered into halves when its weights load).

Inverse frequencies follow transformers' ``modeling_rope_utils`` step by step in float32, so
the cached cos/sin tables are bit-identical to the ones Hugging Face computes per forward.

LongRoPE (Phi-3) has two sets of frequencies: the short ones while a sequence is within the
pre-training length, the long ones past it. Here each sequence of a step picks its set: a
prompt chunk whose sequence reaches past the pre-training length takes the long set for all
its tokens, a decode token by its own position. That is transformers' choice for a prompt
prefilled in one forward and for the tokens decoded after it. Two cases differ: a long prompt
prefilled in chunks (its chunks that end within the pre-training length take the short set)
and a sequence that crosses the length while decoding (transformers then recomputes all of
its KV with the long set; the engine keeps its cached keys, as vLLM does).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.rope_config import RopeConfig


def compute_inv_freq(
    rope: RopeConfig, head_dim: int, long: bool = False
) -> torch.Tensor:  # [head_dim // 2] fp32
    """The inverse frequencies (``long``: LongRoPE's set for sequences past the pre-training
    length)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if rope.scaling_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries; "
                f"head_dim {head_dim} needs {head_dim // 2}"
            )
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "default":
        return inv_freq
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    if rope.scaling_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    raise ValueError(f"unsupported rope scaling type {rope.scaling_type!r}")


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] fp32
    """YaRN: fast-turning dims keep their frequency (extrapolate), slow ones are divided by
    the factor (interpolate), with a linear ramp between the dims that turn ``beta_fast`` and
    ``beta_slow`` times over the pre-training context."""
    original = rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dim that turns ``rotations`` times
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    positions = rope.theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolated = 1.0 / positions
    interpolated = 1.0 / (rope.factor * positions)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # the share of each dim's extrapolated frequency
    return interpolated * (1 - keep) + extrapolated * keep


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
    """Cos/sin tables for every position up to the model's max length, built once (LongRoPE:
    the short set's rows, then the long set's)."""

    cos_sin_cache: torch.Tensor  # [max_positions (x2: longrope), head_dim] fp32: cos then sin

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer("cos_sin_cache", self._build_cache(None), persistent=False)

    def _build_cache(self, device: torch.device | None) -> torch.Tensor:
        if self.rope.scaling_type != "longrope":
            table = self._table(compute_inv_freq(self.rope, self.head_dim), device)
            return table * self.rope.attention_factor if self.rope.scaling_type == "yarn" else table
        short = self._table(compute_inv_freq(self.rope, self.head_dim), device)
        long = self._table(compute_inv_freq(self.rope, self.head_dim, long=True), device)
        return torch.cat((short, long)) * self.rope.attention_factor

    def _table(self, inv_freq: torch.Tensor, device: torch.device | None) -> torch.Tensor:
        """[max_positions, head_dim]: cos then sin of every position's angles."""
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
        rows = positions if self.rope.scaling_type != "longrope" else self._longrope_rows(positions)
        cos_sin = self.cos_sin_cache.index_select(0, rows).to(dtype)  # [num_tokens, head_dim]
        cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)
        return cos, sin

    def _longrope_rows(self, positions: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64
        """The table row of each token: its position, in the long set's half where its sequence
        reaches past the pre-training length (see the module docstring)."""
        original = self.rope.original_max_position_embeddings
        long = positions >= original  # a decode token (or padding) by its own position
        metadata = get_forward_context().attn_metadata
        starts = metadata.prefill_query_start_loc
        for seq, seq_len in enumerate(metadata.prefill_seq_lens):
            long[starts[seq] : starts[seq + 1]] = seq_len > original
        return positions + long.to(positions.dtype) * self.max_positions


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Rotate-half rope; the same elementwise ops as transformers' apply_rotary_pos_emb."""
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, num_heads, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
