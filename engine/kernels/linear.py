"""The projections' matmul backend: torch's ``F.linear``, or oneDNN with prepacked weights.

PyTorch's x86 wheels run float32 ``F.linear`` through MKL; oneDNN picks its kernels by the
instruction set the CPU has, and a weight reordered once into its blocked layout is not
repacked per call. On the project's 2-core AMD EPYC machine, one thread, all the demo model's
projections: 1.45x MKL's speed for 1 token, 2.0x for 8, 2.3x for 192 (``python -m
bench.linear_backends``, docs/benchmarks.md). vLLM's CPU backend uses oneDNN for the same
reason.

``pack_linears(model)`` swaps every ``nn.Linear`` for a ``PackedLinear`` that holds only the
packed weight (the model loader gives a tied logits projection its own packed copy). Results
differ from MKL's in the last bits (another summation order), as MKL's own results differ
between batch sizes.

Backends: "torch" (always), "onednn" (CPU, float32, or bfloat16 where the CPU has it),
"auto" (onednn where it applies, else torch).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn


def onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs for this device and dtype in this torch build."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_linear_backend(
    name: str, device: torch.device, dtype: torch.dtype
) -> Literal["torch", "onednn"]:
    """The backend ``name`` (auto | torch | onednn, checked by LoadConfig) resolves to here;
    raises ValueError naming the field when "onednn" cannot run on this device and dtype."""
    if name == "torch":
        return "torch"
    if onednn_supports(device, dtype):
        return "onednn"
    if name == "onednn":
        raise ValueError(
            f"linear_backend 'onednn' needs a CPU device and float32 (or bfloat16 on a CPU "
            f"with bf16 instructions); got device {device.type}, dtype {dtype}"
        )
    return "torch"


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` through oneDNN, W reordered once into oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch-size hint None: one layout that serves every number of tokens
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        assert x.dim() == 2 and x.shape[1] == self.in_features, (
            f"PackedLinear expects [num_tokens, {self.in_features}], got {tuple(x.shape)}"
        )
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module) -> int:
    """Replace each ``nn.Linear`` in ``model`` by a PackedLinear; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, child_name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
