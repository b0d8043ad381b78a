"""RMSNorm, fused where a kernel takes the tensor (fused_ops.py), else in torch."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.fused_ops import kernels_for


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, then scaled (transformers' LlamaRMSNorm order)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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
