"""Which kernels take the model's elementwise steps (RMSNorm, residual add + RMSNorm, rotary,
SiLU * up) for a tensor: the C kernels on CPU in float32 or bfloat16, the Triton kernels on a
GPU, or none, and then the model's own torch code runs."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kernels import elementwise as triton_kernels
from engine.kernels.cpu import elementwise as cpu_kernels


class ElementwiseKernels(Protocol):
    """What both kernel modules provide; each call is one pass over the activations."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary_(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def kernels_for(x: torch.Tensor) -> ElementwiseKernels | None:
    """The fused kernels that take ``x``, or None for the torch path."""
    if cpu_kernels.usable(x):
        return cpu_kernels
    if triton_kernels.usable(x):
        return triton_kernels
    return None


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2d] -> [n, d]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2d] -> [n, d]
    """SiLU(gate) * up, through the fused kernel that takes ``gate_up`` or in torch."""
    kernels = kernels_for(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    return torch_silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2d] -> [n, d]
    """GELU(gate) with the tanh approximation, times up (Gemma's MLP), in torch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
