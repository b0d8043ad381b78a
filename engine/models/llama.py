"""One decoder-only transformer for Llama, Mistral, Qwen2 and Qwen3 checkpoints.

They differ only in flags of ModelConfig: q/k/v (and o) biases, per-head q/k RMSNorm (Qwen3),
tied embeddings, rope scaling. Projections are fused (qkv_proj, gate_up_proj) so each layer
runs three big matmuls instead of six; model_loader.py maps the Hugging Face weights onto them.
The elementwise steps (norms, rotary, SiLU * up) run as fused kernels where some take the
tensor (fused_ops.py: C on CPU in float32, Triton on a GPU); the torch code beside each is the
path everywhere else, and what the kernels are tested against.
Module names otherwise mirror Hugging Face's (model.layers.N.self_attn.o_proj, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import Attention
from engine.model_config import ModelConfig
from engine.models.fused_ops import kernels_for
from engine.models.rope import RotaryEmbedding, apply_rotary


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, then scaled (transformers' LlamaRMSNorm order)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2d] -> [n, d]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, fused where a kernel takes the tensor, else torch_rms_norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        kernels = kernels_for(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return torch_rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)
        kernels = kernels_for(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        return self.down_proj(torch_silu_and_mul(gate_up))


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = Attention(
            layer_idx,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            scale=config.head_dim**-0.5,
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kernels = kernels_for(q)
        if kernels is not None:
            kernels.rotary_(q, k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin)
        kernels = kernels_for(hidden)
        if kernels is not None:  # the residual add and the norm in one pass
            norm = self.post_attention_layernorm
            hidden, normed = kernels.add_rms_norm(hidden, attended, norm.weight, norm.eps)
            return hidden + self.mlp(normed)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """The "model." part of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

    Runs inside set_forward_context(): attention reads the batch layout and KV cache there.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # None: the logits reuse the embedding matrix (a packed linear backend gives it a copy)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size], final norm applied
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()
