"""Multi-head latent attention (DeepSeek-V2/V3), the self-attention of their decoder layers.

Each token's keys and values for every head come from one latent vector: ``kv_a_proj_with_mqa``
projects the hidden state down to the latent (``kv_lora_rank``, then RMS-normed) and a rotary
key part (``qk_rope_head_dim``) every head shares; ``kv_b_proj`` would project the latent up
to each head's non-rotary key (``qk_nope_head_dim``) and its value (``v_head_dim``). The KV
cache holds only the latent and the rotary key, one entry per token and layer.

Attention runs in the absorbed form for every token (prompt chunks and decode alike): a head's
non-rotary query is multiplied by its key up-projection (W_UK, rows of ``kv_b_proj``) into the
latent space, so it scores the cached latent directly; with its rotary part appended it scores
a whole entry, and the heads share one KV head (MQA, ``LatentCacheAttention``). The weighted
sum of latents comes back through the head's value up-projection (W_UV) before ``o_proj``. No
per-head key or value is ever materialised. Transformers computes the same numbers the other
way round (up-projecting the cached latents); the two agree up to float rounding.

The query has its own low-rank bottleneck where ``q_lora_rank`` is set (``q_a_proj``, an
RMSNorm, ``q_b_proj``), else one ``q_proj``. The two small norms use epsilon 1e-6, as
transformers builds them whatever ``rms_norm_eps`` says.

Quantized checkpoints (DeepSeek-V3's FP8 blocks, packed integers): the projections that run as
layers are the dense layers' quantized ones (``make_linear``). ``kv_b_proj`` is loaded in its
quantized layout, then dequantized once into the float matrices the absorption multiplies by
(``absorb_in``; it is small: kv_lora_rank columns). Their interleaved rope rows
are not moved within quantized blocks or words: the rotary dims of the query and the key are
gathered into halves as they come out of the projections instead (``rope_order``).

Tensor parallelism: a rank computes its query heads (the rows of ``q_proj``/``q_b_proj`` and of
``kv_b_proj`` for those heads, the columns of ``o_proj``, one all-reduce after it). The down
projections, their norms and so the latent cache are the same on every rank (the cache's one
KV head is replicated, as the sharding does for any model with fewer KV heads than ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.layer import LatentCacheAttention
from engine.model_config import ModelConfig
from engine.models.rms_norm import RMSNorm
from engine.models.rope import apply_rotary
from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import TensorParallelShard
from engine.quantization.linear import QuantizedLinear, make_linear

SMALL_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's epsilon, as transformers has it


class UpProjection(nn.Module):
    """The latent's up projection to each head's non-rotary key, then its value (rows per
    head: ``qk_nope_head_dim`` then ``v_head_dim``). Only ever absorbed into the query and the
    output, never applied as a layer; not an ``nn.Linear``, so no linear backend repacks it."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class LatentAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        shard: TensorParallelShard,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError(f"{config.architecture} has no latent attention (ModelConfig.mla)")
        self.mla = mla
        self.num_heads = len(shard.q_heads)
        hidden, heads = config.hidden_size, self.num_heads
        quantized = config.quantization
        self.q_proj: nn.Linear | QuantizedLinear | None = None
        self.q_a_proj: nn.Linear | QuantizedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | QuantizedLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = make_linear(hidden, heads * mla.qk_head_dim, False, quantized)
        else:
            self.q_a_proj = make_linear(hidden, mla.q_lora_rank, False, quantized)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, SMALL_NORM_EPS)
            self.q_b_proj = make_linear(mla.q_lora_rank, heads * mla.qk_head_dim, False, quantized)
        self.kv_a_proj_with_mqa = make_linear(hidden, mla.latent_width, False, quantized)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, SMALL_NORM_EPS)
        up_rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        # quantized: loaded as the checkpoint holds it, then ``absorb_in``
        self.kv_b_proj: UpProjection | QuantizedLinear = UpProjection(up_rows, mla.kv_lora_rank)
        if quantized is not None:
            up_layer = make_linear(mla.kv_lora_rank, up_rows, False, quantized)
            assert not isinstance(up_layer, nn.Linear)
            self.kv_b_proj = up_layer
        self.o_proj = make_linear(heads * mla.v_head_dim, hidden, False, quantized, row_group=group)
        # [qk_rope_head_dim]: the rotary dims of q and k in halves, gathered from the interleaved
        # pairs quantized projections keep; None: the projections' rows give them in halves
        self.rope_order: torch.Tensor | None = None
        self.attn = LatentCacheAttention(
            config.cache_groups.place(layer_idx),
            heads,
            scale=mla.softmax_scale,
            value_dim=mla.kv_lora_rank,
        )
        self.group = group

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, qk_rope_head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, qk_rope_head_dim // 2]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        mla, heads = self.mla, self.num_heads
        num_tokens = hidden.shape[0]
        query = self._query(hidden).view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rope = query.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())  # [num_tokens, kv_lora_rank]
        if self.rope_order is not None:
            q_rope, k_rope = q_rope[..., self.rope_order], k_rope[..., self.rope_order]
        q_rope = apply_rotary(q_rope, cos, sin)  # [num_tokens, heads, qk_rope_head_dim]
        k_rope = apply_rotary(k_rope[:, None], cos, sin)[:, 0]  # [num_tokens, qk_rope_head_dim]
        entries = torch.cat((latent, k_rope), dim=-1)  # [num_tokens, latent_width]
        # each head's key and value up-projections: [heads, nope + v, kv_lora_rank]
        up_projection = self.kv_b_proj
        if not isinstance(up_projection, UpProjection):
            raise RuntimeError("kv_b_proj is still quantized: load the model (model_loader.py)")
        up = up_projection.weight.view(heads, -1, mla.kv_lora_rank)
        key_up, value_up = up.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        # (in the up projection's dtype: float32 on a CPU, ``absorb_in``)
        q_nope = q_nope.transpose(0, 1).to(up.dtype)
        q_latent = torch.bmm(q_nope, key_up).to(hidden.dtype)  # [heads, n, kv_lora_rank]
        absorbed = torch.cat((q_latent.transpose(0, 1), q_rope), dim=-1)  # [n, heads, width]
        out_latent = self.attn(absorbed, entries)  # [num_tokens, heads, kv_lora_rank]
        out_latent = out_latent.transpose(0, 1).to(up.dtype)
        out = torch.bmm(out_latent, value_up.transpose(1, 2)).to(hidden.dtype)  # [heads, n, v]
        out = out.transpose(0, 1).reshape(num_tokens, heads * mla.v_head_dim)
        return self.group.all_reduce(self.o_proj(out))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, heads * qk_head_dim]
        if self.q_proj is not None:
            return self.q_proj(hidden)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None
        assert self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def rope_rows_interleaved_to_halves(self) -> None:
        """Reorder the rows that make the rotary dims from interleaved pairs (x0, x1), (x2,
        x3), ... into halves (x0, x2, ...; x1, x3, ...), so the rotate-half rope computes what
        the checkpoint's interleaved rope did, in the layout transformers caches. Quantized
        projections keep their rows (a block or a packed word spans several): their outputs'
        rotary dims are gathered in that order instead (``rope_order``)."""
        mla = self.mla
        rope = mla.qk_rope_head_dim
        order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        query_proj = self.q_proj if self.q_proj is not None else self.q_b_proj
        assert query_proj is not None
        kv_proj = self.kv_a_proj_with_mqa
        if not isinstance(query_proj, nn.Linear) or not isinstance(kv_proj, nn.Linear):
            self.rope_order = order.to(self.kv_a_layernorm.weight.device)
            return
        with torch.no_grad():
            rows = query_proj.weight.view(self.num_heads, mla.qk_head_dim, -1)
            rows[:, mla.qk_nope_head_dim :] = rows[:, mla.qk_nope_head_dim :][
                :, order.to(rows.device)
            ]
            kv_rows = kv_proj.weight
            kv_rows[mla.kv_lora_rank :] = kv_rows[mla.kv_lora_rank :][order.to(kv_rows.device)]

    def absorb_in(self, dtype: torch.dtype) -> None:
        """``kv_b_proj``, loaded, becomes the float weight the absorption multiplies by, in
        ``dtype`` (a quantized one dequantized)."""
        with torch.no_grad():
            if isinstance(self.kv_b_proj, UpProjection):
                weight = self.kv_b_proj.weight.to(dtype)
            else:
                weight = self.kv_b_proj.dequantized_weight().to(dtype)
        up = UpProjection(0, 0)
        up.weight = nn.Parameter(weight, requires_grad=False)
        self.kv_b_proj = up
