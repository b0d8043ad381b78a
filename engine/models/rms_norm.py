"""RMSNorm, fused where a kernel takes the tensor (fused_ops.py), else in torch; and Gemma's,
which scales by (1 + weight) in float32 throughout."""

from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.fused_ops import kernels_for
from engine.parallel.group import TensorParallelGroup


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, then scaled (transformers' LlamaRMSNorm order)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, fused where a kernel takes the tensor, else torch_rms_norm."""

    offset = 0.0  # the norm scales by offset + weight

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        kernels = kernels_for(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return torch_rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, residual: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # residual + x, and its norm
        """The residual add and the norm, in one pass where a kernel takes the tensors."""
        kernels = kernels_for(residual)
        if kernels is not None:
            return kernels.add_rms_norm(residual, x, self.weight, self.eps)
        summed = residual + x
        return summed, self(summed)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalised in float32, scaled by (offset + weight) in float32, then cast
    back (transformers' Gemma3RMSNorm order; with offset 0, GptOssRMSNorm's); torch only."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__(dim, eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).to(x.dtype)

    def add_and_norm(
        self, residual: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # residual + x, and its norm
        """In torch: the fused kernel scales in Llama's order."""
        summed = residual + x
        return summed, self(summed)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across tensor-parallel ranks (MiniMax-M2's q and k norms, over
    all heads at once): each rank holds its heads' slice of the vector and of the weight, and
    the squares' sum is all-reduced. ``replicas``: the ranks that hold each element (KV heads
    replicated on several ranks), whose sum counts it that many times."""

    def __init__(
        self, dim: int, full_dim: int, eps: float, group: TensorParallelGroup, replicas: int
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.full_dim, self.eps, self.group, self.replicas = full_dim, eps, group, replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, dim] -> [n, dim]
        x32 = x.to(torch.float32)
        squares = self.group.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas
        x32 = x32 * torch.rsqrt(squares / self.full_dim + self.eps)
        return self.weight * x32.to(x.dtype)


def rms_norm_for(config: ModelConfig, dim: int) -> RMSNorm:
    """The model's RMSNorm over ``dim``: Gemma's where its weights are offsets from 1, and
    gpt-oss's (scaled before the cast back) in the same float32 order."""
    if config.norm_weight_offset or config.norm_scale_in_float32:
        return OffsetRMSNorm(dim, config.rms_norm_eps, config.norm_weight_offset)
    return RMSNorm(dim, config.rms_norm_eps)
