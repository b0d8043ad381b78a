"""A linear layer of 8-bit weights whose inputs are quantized per token as they arrive
(compressed-tensors' W8A8: int8, and FP8_DYNAMIC: float8 e4m3).

Its tensors are the checkpoint's: ``weight`` [out, in] int8 or float8_e4m3fn and
``weight_scale`` [out, 1], a scale per output row. The forward quantizes each input row (a
token) to the weights' type with a scale of its own, its largest magnitude over the type's
half range (127.5 for int8, as compressed-tensors computes it; 448 for float8; a row-parallel
layer's ranks share each row's largest magnitude, so the scale is the whole row's on every
tensor-parallel size), and multiplies by the dequantized weight: the arithmetic of compressed-tensors' fake quantization, which
transformers runs on these checkpoints. On CPU that is the correct path; the GPU's int8 and
FP8 GEMMs (the same scales, applied after an integer or float8 matmul) are to come.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.group import TensorParallelGroup
from engine.quantization.config import W8A8Weights

_ELEMENT = {"int": torch.int8, "float": torch.float8_e4m3fn}
_RANGE = {"int": (-128.0, 127.0), "float": (-448.0, 448.0)}


def quantize_per_token(
    x: torch.Tensor, kind: str, row_group: TensorParallelGroup | None = None
) -> torch.Tensor:
    """``x`` [rows, features] quantized and dequantized row by row, as compressed-tensors'
    dynamic per-token quantization computes it (in x's dtype). ``row_group``: the ranks that
    each hold some of every row's features (a row-parallel layer's), whose largest magnitudes
    make the row's scale."""
    low, high = _RANGE[kind]
    largest = torch.maximum(
        x.amin(-1, keepdim=True).clamp(max=0).abs(), x.amax(-1, keepdim=True).clamp(min=0)
    )  # [rows, 1]
    if row_group is not None and row_group.size > 1:
        largest = row_group.all_gather(largest).amax(-1, keepdim=True)
    scale = largest / (torch.tensor(high - low, dtype=x.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    scaled = (x / scale).clamp(low, high)
    rounded = torch.round(scaled) if kind == "int" else scaled.to(torch.float8_e4m3fn).to(x.dtype)
    return rounded.to(scale.dtype) * scale


class W8A8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        weights: W8A8Weights,
        row_group: TensorParallelGroup | None = None,
    ) -> None:
        """``row_group``: the ranks a row-parallel layer's inputs are split over (None: this
        rank holds every input feature)."""
        super().__init__()
        self.row_group = row_group
        self.in_features = in_features
        self.out_features = out_features
        self.weights = weights
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=_ELEMENT[weights.kind]),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def keep_quantized_dtypes(self) -> None:
        """Make the weight 8-bit again after the model was cast to its dtype (``Module.to``
        casts every floating tensor, float8 ones included)."""
        self.weight = nn.Parameter(
            self.weight.detach().to(_ELEMENT[self.weights.kind]), requires_grad=False
        )

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] in the scale's dtype
        return self.weight.to(self.weight_scale.dtype) * self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = quantize_per_token(x.reshape(-1, x.shape[-1]), self.weights.kind, self.row_group)
        weight = self.dequantized_weight().to(x.dtype)
        return F.linear(rows.reshape(x.shape), weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights.describe()}"
        )
