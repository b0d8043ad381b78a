"""One decoder-only transformer for Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 2/3 checkpoints,
for the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, GLM-4.5 and MiniMax-M2, and
for DeepSeek-V2/V3.

They differ only in flags of ModelConfig: q/k/v (and o) biases, per-head q/k RMSNorm (Qwen3,
Gemma 3, GLM-4.5) or one over all heads (MiniMax-M2), tied embeddings, rope scaling (and
Gemma 3's second rope for its local layers), rope on part of each head (GLM-4.5, MiniMax-M2,
Phi-3's partial_rotary_factor), sliding windows, soft-capped logits and sinks (attention),
Gemma's norms and sandwich, the sparse MLP that replaces the dense one in the layers
``ModelConfig.moe`` names (moe.py), and latent attention in place of multi-head attention
where ``ModelConfig.mla`` is set (mla.py).
Projections are fused (qkv_proj, gate_up_proj) so each layer runs three big matmuls instead of
six; model_loader.py maps the Hugging Face weights onto them.
The elementwise steps (norms, rotary, SiLU * up) run as fused kernels where some take the
tensor (fused_ops.py: C on CPU in float32, Triton on a GPU); the torch code beside each is the
path everywhere else, and what the kernels are tested against.
Module names otherwise mirror Hugging Face's (model.layers.N.self_attn.o_proj, ...).

Tensor parallelism (engine/parallel/): each rank builds the layers with its shard's sizes.
qkv_proj and gate_up_proj are column-parallel (the rank's heads' and columns' rows), o_proj and
down_proj row-parallel (its input columns) and followed by one all-reduce each; a row-parallel
bias is held by rank 0 only (zeros elsewhere), so the sum adds it once. The embedding and the
LM head hold the rank's vocab rows: ids outside them embed to zeros before an all-reduce, and
compute_logits gathers every rank's logits. Every rank must run forward and compute_logits on
the same batch. With one rank the collectives are the identity and the code is the plain model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import Attention
from engine.model_config import ModelConfig
from engine.models.fused_ops import gelu_tanh_and_mul, kernels_for, silu_and_mul
from engine.models.mla import LatentAttention
from engine.models.moe import SparseMoeBlock
from engine.models.rms_norm import RMSNorm, ShardedRMSNorm, rms_norm_for
from engine.models.rope import RotaryEmbedding, apply_rotary
from engine.parallel.group import SingleRank, TensorParallelGroup
from engine.parallel.shard import TensorParallelShard
from engine.quantization.linear import make_linear


class GatedMLP(nn.Module):
    """gate_up_proj holds the shard's intermediate rows of gate then of up; down_proj its columns."""

    def __init__(
        self, config: ModelConfig, shard: TensorParallelShard, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        intermediate = len(shard.intermediate)
        quantized = config.quantization
        self.gate_up_proj = make_linear(
            config.hidden_size, 2 * intermediate, config.mlp_bias, quantized
        )
        self.down_proj = make_linear(
            intermediate, config.hidden_size, config.mlp_bias, quantized, row_group=group
        )
        self.act_and_mul = gelu_tanh_and_mul if config.activation == "gelu_tanh" else silu_and_mul
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate on this rank]
        return self.group.all_reduce(self.down_proj(self.act_and_mul(gate_up)))


class SelfAttention(nn.Module):
    """qkv_proj holds the shard's query heads' rows, then its KV heads' k rows, then v rows;
    o_proj its query heads' columns."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        shard: TensorParallelShard,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        # the first dims of a head that rope turns (all of them but GLM-4.5's and MiniMax-M2's)
        self.rotary_dim = config.rope_dim
        q_size = self.num_heads * config.head_dim
        kv_size = self.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        quantized = config.quantization
        self.qkv_proj = make_linear(
            config.hidden_size, q_size + 2 * kv_size, config.qkv_bias, quantized
        )
        self.o_proj = make_linear(
            q_size, config.hidden_size, config.o_proj_bias, quantized, row_group=group
        )
        # per head (Qwen3, Gemma 3, GLM-4.5), or over all heads at once (MiniMax-M2)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.norms_across_heads = config.qk_norm_across_heads
        if config.qk_norm:
            self.q_norm = rms_norm_for(config, config.head_dim)
            self.k_norm = rms_norm_for(config, config.head_dim)
        elif config.qk_norm_across_heads:
            self.q_norm, self.k_norm = _norms_across_heads(config, shard, group)
        scale = config.attention_scale
        self.attn = Attention(
            config.cache_groups.place(layer_idx),
            self.num_heads,
            self.num_kv_heads,
            config.head_dim,
            scale=scale if scale is not None else config.head_dim**-0.5,
            sliding_window=config.sliding_window if layer_idx in config.sliding_layers else None,
            logit_softcap=config.attention_logit_softcap,
            num_sinks=self.num_heads if config.attention_sinks else 0,
        )
        self.group = group

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, rotary_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, rotary_dim // 2]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        if self.norms_across_heads and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not self.norms_across_heads and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kernels = kernels_for(q)
        if self.rotary_dim != self.head_dim:  # the rest of each head passes through
            q, k = (
                _rotate_first(q, cos, sin, self.rotary_dim),
                _rotate_first(k, cos, sin, self.rotary_dim),
            )
        elif kernels is not None:
            kernels.rotary_(q, k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.group.all_reduce(self.o_proj(self.attn(q, k, v)))


def _norms_across_heads(
    config: ModelConfig, shard: TensorParallelShard, group: TensorParallelGroup
) -> tuple[nn.Module, nn.Module]:
    """MiniMax-M2's q and k norms over all heads: the plain norm on one rank; on several, each
    rank's slice with the squares' sum all-reduced (a KV head replicated on r ranks counted r
    times in it, divided back)."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    if shard.size == 1:
        return rms_norm_for(config, q_width), rms_norm_for(config, kv_width)
    eps = config.rms_norm_eps
    kv_replicas = max(1, shard.size // config.num_kv_heads)
    q_norm = ShardedRMSNorm(len(shard.q_heads) * config.head_dim, q_width, eps, group, 1)
    k_norm = ShardedRMSNorm(shard.num_kv_heads * config.head_dim, kv_width, eps, group, kv_replicas)
    return q_norm, k_norm


def _rotate_first(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, rotary_dim // 2]
    rotary_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Rope on each head's first ``rotary_dim`` dims (rotate-half within them), as
    transformers' partial rotary embeddings do."""
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        shard: TensorParallelShard,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = rms_norm_for(config, config.hidden_size)
        self.self_attn: SelfAttention | LatentAttention = (
            LatentAttention(config, layer_idx, shard, group)
            if config.mla is not None
            else SelfAttention(config, layer_idx, shard, group)
        )
        self.post_attention_layernorm = rms_norm_for(config, config.hidden_size)
        self.mlp = _layer_mlp(config, layer_idx, shard, group)
        # Gemma's sandwich: post_attention_layernorm closes the attention, these two the MLP
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm_for(config, config.hidden_size)
            self.post_feedforward_layernorm = rms_norm_for(config, config.hidden_size)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin)
        pre_mlp, post_mlp = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre_mlp is not None and post_mlp is not None:
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + post_mlp(self.mlp(pre_mlp(hidden)))
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, attended)
        return hidden + self.mlp(normed)


def _layer_mlp(
    config: ModelConfig, layer_idx: int, shard: TensorParallelShard, group: TensorParallelGroup
) -> GatedMLP | SparseMoeBlock:
    """The layer's sparse MLP where the model's config makes it sparse, else the dense one."""
    moe = config.moe
    if moe is None or layer_idx not in moe.sparse_layers:
        return GatedMLP(config, shard, group)
    expert_width = len(shard.expert_intermediate)
    shared_width = len(shard.shared_expert_intermediate)
    return SparseMoeBlock(
        moe,
        config.hidden_size,
        layer_idx,
        expert_width,
        shared_width,
        group,
        config.quantization,
        shard.experts,
    )


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of the shard's vocab range; a row past the vocabulary holds zeros."""

    def __init__(
        self, config: ModelConfig, shard: TensorParallelShard, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows, config.hidden_size))
        self.first_id = shard.vocab.start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden_size]
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.first_id
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])  # [n] bool
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))


class DecoderModel(nn.Module):
    """The "model." part of the checkpoint: embeddings, layers, final norm."""

    def __init__(
        self, config: ModelConfig, shard: TensorParallelShard, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config, shard, group)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, shard, group) for i in range(config.num_layers)
        )
        self.norm = rms_norm_for(config, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.rope_dim, config.max_position_embeddings, config.rope
        )
        # Gemma 3: the sliding layers turn by their own rope
        self.local_rotary_emb: RotaryEmbedding | None = None
        if config.local_rope is not None:
            self.local_rotary_emb = RotaryEmbedding(
                config.rope_dim, config.max_position_embeddings, config.local_rope
            )
        self.local_layers = frozenset(config.sliding_layers if config.local_rope else ())
        self.embedding_multiplier = config.embedding_multiplier

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if self.embedding_multiplier != 1.0:  # the scale in the model's dtype, as transformers
            hidden = hidden * torch.tensor(self.embedding_multiplier, dtype=hidden.dtype)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        local = cos, sin
        if self.local_rotary_emb is not None:
            local = self.local_rotary_emb(positions, hidden.dtype)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, *(local if index in self.local_layers else (cos, sin)))
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Serves every architecture of SUPPORTED_ARCHITECTURES (see the module docstring).

    Runs inside set_forward_context(): attention reads the batch layout and KV cache there.
    With a shard of several ranks, forward and compute_logits are collectives of ``group``.
    """

    def __init__(
        self,
        config: ModelConfig,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        shard = shard if shard is not None else TensorParallelShard.whole(config)
        group = group if group is not None else SingleRank()
        if (group.rank, group.size) != (shard.rank, shard.size):
            raise ValueError(
                f"shard of rank {shard.rank} of {shard.size} given a group where this process "
                f"is rank {group.rank} of {group.size}"
            )
        self.config = config
        self.shard = shard
        self.group = group
        self.model = DecoderModel(config, shard, group)
        # None: the logits reuse the embedding matrix (a packed linear backend gives it a copy)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, shard.vocab_rows, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size], final norm applied
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """Float32 logits over the whole vocabulary, on every rank."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)  # [n, vocab_rows]
        else:
            logits = self.lm_head(hidden)
        if self.group.size > 1:  # [n, size * vocab_rows], padding rows last
            logits = self.group.all_gather(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        if cap is not None:  # in the model's dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float().contiguous()
