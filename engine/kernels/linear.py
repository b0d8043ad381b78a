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

oneDNN builds a kernel for each number of rows it is given (a JIT compile, 0.15-0.45 ms per
projection shape here) and keeps a bounded number of them (1024). A server's steps come with
ever-new token counts (a prompt's length plus the decodes beside it), so a prefill step would
build its projections' kernels anew each time. So the model runner pads a step's rows, for a
model with packed linears, to ``padded_rows``: exact up to ``EXACT_ROWS`` (decode batches, where
a padding row would cost a weight-bound step a whole row of work), above that the next multiple
of 1/16 of the count's power of two (at most 1/16 more rows). The counts a server sees fall on
a few buckets, whose kernels stay built.

Backends: "torch" (always), "onednn" (CPU, float32, or bfloat16 where the CPU has it),
"auto" (onednn where it applies, else torch).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

EXACT_ROWS = 64  # token counts up to this one run as they are
ROW_BUCKETS_PER_OCTAVE = 16  # above it, the counts run between two powers of two


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


def padded_rows(num_rows: int) -> int:
    """The rows a step of ``num_rows`` tokens runs with packed linears: ``num_rows`` itself up
    to ``EXACT_ROWS``, else the next multiple of 1/``ROW_BUCKETS_PER_OCTAVE`` of its power of
    two (65-127 rows: multiples of 4; 128-255: of 8; 256-511: of 16; ...)."""
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = (1 << (num_rows.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE
    return -(-num_rows // step) * step


def has_packed_linears(model: object) -> bool:
    """Whether ``model`` (a module) runs any projection through oneDNN."""
    return isinstance(model, nn.Module) and any(
        isinstance(module, PackedLinear) for module in model.modules()
    )


def pack_linears(model: nn.Module) -> int:
    """Replace each ``nn.Linear`` in ``model`` by a PackedLinear; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, child_name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
