"""A linear layer of 8-bit weights whose inputs are quantized to the same type as they arrive
(compressed-tensors' W8A8: int8, FP8_DYNAMIC and FP8: float8 e4m3).

Its tensors: ``weight`` [out, in] int8 or float8_e4m3fn, as the checkpoint holds it;
``weight_scale`` [out, 1], a scale per output row: the checkpoint's own ("channel"), or its
one scale per weight tensor ("tensor") repeated over that tensor's rows, so each part of a
fused projection (q, k, v; gate, up) keeps its own scale and the weight dequantizes exactly as
the checkpoint's parts do; and, with static inputs, ``input_scale`` [out, 1], each row's
part's input scale the same way.

The forward quantizes and dequantizes the input (compressed-tensors' fake quantization, which
transformers runs on these checkpoints) and multiplies by the dequantized weight:
- dynamic inputs: each input row (a token) with a scale of its own, its largest magnitude over
  the type's half range (127.5 for int8, as compressed-tensors computes it; 448 for float8);
  a row-parallel layer's ranks share each row's largest magnitude, so the scale is the whole
  row's on every tensor-parallel size;
- static inputs: every row with the layer's fixed scale, ``clamp(x / scale)`` to the type's
  range ([-128, 127]; [-448, 448]) rounded (int8: half to even; float8: to the nearest e4m3,
  ties to even) times the scale. A fused projection's parts read the same input, each with its
  own scale as transformers' separate modules do: the input is quantized once per distinct
  scale and each part's rows multiply their own (``input_scale_blocks``). Row-parallel ranks
  hold the whole layer's scale, so each quantizes its share of the features alone.
On CPU that is the path. On CUDA the same scales run through the 8-bit GEMMs of
engine/kernels/scaled_matmul.py: the input quantized the same way, an int8 (int32 accumulate)
or float8 (float32 accumulate) matmul, then the input's and weight's scales applied to the
product (not rounded through the activations' dtype first, as the fake quantization is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import scaled_matmul
from engine.parallel.group import TensorParallelGroup
from engine.quantization.config import W8A8Weights

_ELEMENT = {"int": torch.int8, "float": torch.float8_e4m3fn}
_RANGE = {"int": (-128.0, 127.0), "float": (-448.0, 448.0)}

# (first row, end row, the row whose input scale they use: the first holding that value)
InputScaleBlock = tuple[int, int, int]


def quantize_per_token(
    x: torch.Tensor, kind: str, row_group: TensorParallelGroup | None = None
) -> torch.Tensor:
    """``x`` [rows, features] quantized and dequantized row by row, as compressed-tensors'
    dynamic per-token quantization computes it (in x's dtype). ``row_group``: the ranks that
    each hold some of every row's features (a row-parallel layer's), whose largest magnitudes
    make the row's scale."""
    largest = row_largest(x, row_group)  # [rows, 1]
    low, high = _RANGE[kind]
    scale = largest / (torch.tensor(high - low, dtype=x.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    return quantize_with_scale(x, scale, kind)


def row_largest(
    x: torch.Tensor, row_group: TensorParallelGroup | None = None
) -> torch.Tensor:  # [rows, 1] of x's dtype
    """Each row's largest magnitude, over every rank of ``row_group`` (see
    ``quantize_per_token``)."""
    largest = torch.maximum(
        x.amin(-1, keepdim=True).clamp(max=0).abs(), x.amax(-1, keepdim=True).clamp(min=0)
    )
    if row_group is not None and row_group.size > 1:
        largest = row_group.all_gather(largest).amax(-1, keepdim=True)
    return largest


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` quantized to ``kind`` with ``scale`` (broadcast: [1] a static per-tensor scale,
    [rows, 1] one per row) and dequantized, as compressed-tensors' ``fake_quantize`` computes
    it: ``x / scale`` clamped to the type's range, rounded (int8: half to even; float8 e4m3:
    nearest, ties to even), cast to the scale's dtype and multiplied by it."""
    low, high = _RANGE[kind]
    scaled = (x / scale).clamp(low, high)
    if kind == "int":
        rounded = torch.round(scaled)
    else:
        rounded = scaled.to(torch.float8_e4m3fn).to(scaled.dtype)
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
        # static inputs: each row's input scale (its fused part's)
        self.input_scale = (
            nn.Parameter(torch.empty(out_features, 1)) if weights.static_inputs else None
        )
        # rows sharing one input scale; one block until ``group_rows_by_input_scale``
        self.input_scale_blocks: tuple[InputScaleBlock, ...] = ((0, out_features, 0),)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def keep_quantized_dtypes(self) -> None:
        """Make the weight 8-bit again after the model was cast to its dtype (``Module.to``
        casts every floating tensor, float8 ones included)."""
        self.weight = nn.Parameter(
            self.weight.detach().to(_ELEMENT[self.weights.kind]), requires_grad=False
        )

    def group_rows_by_input_scale(self) -> None:
        """Finds the runs of rows whose input scale is the same (a fused projection's parts,
        or all its rows where the parts' scales agree), once the scales are loaded."""
        if self.input_scale is None:
            return
        values, counts = torch.unique_consecutive(
            self.input_scale.detach().reshape(-1).cpu(), return_counts=True
        )
        first_row_of: dict[float, int] = {}  # a scale -> the first row holding it
        blocks: list[InputScaleBlock] = []
        start = 0
        for value, count in zip(values.tolist(), counts.tolist(), strict=True):
            blocks.append((start, start + count, first_row_of.setdefault(value, start)))
            start += count
        self.input_scale_blocks = tuple(blocks)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] in the scale's dtype
        return self.weight.to(self.weight_scale.dtype) * self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in]
        if scaled_matmul.usable(rows):
            return self._kernel_forward(rows).reshape(*x.shape[:-1], self.out_features)
        weight = self.dequantized_weight().to(x.dtype)
        if self.input_scale is None:
            quantized = quantize_per_token(rows, self.weights.kind, self.row_group)
            return F.linear(quantized.reshape(x.shape), weight, self.bias)
        return self._static_forward(rows, weight).reshape(*x.shape[:-1], self.out_features)

    def _kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:  # [num_tokens, out]
        """The 8-bit GEMM: per-token scales (the whole row's on a row-parallel rank), or each
        block of rows with its static input scale."""
        kind = self.weights.kind
        if self.input_scale is None:
            largest = None
            if self.row_group is not None and self.row_group.size > 1:
                largest = row_largest(rows, self.row_group)
            return scaled_matmul.w8a8_matmul(
                rows, self.weight, self.weight_scale, kind, self.bias, row_largest=largest
            )
        outputs = [
            scaled_matmul.w8a8_matmul(
                rows,
                self.weight[start:stop],
                self.weight_scale[start:stop],
                kind,
                None if self.bias is None else self.bias[start:stop],
                input_scale=self.input_scale[source],
            )
            for start, stop, source in self.input_scale_blocks
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def _static_forward(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Each block of rows multiplies the input quantized with its own scale."""
        assert self.input_scale is not None
        quantized: dict[int, torch.Tensor] = {}  # source row -> the input quantized with its
        outputs = []
        for start, stop, source in self.input_scale_blocks:
            if source not in quantized:
                scale = self.input_scale[source]  # [1]
                quantized[source] = quantize_with_scale(rows, scale, self.weights.kind)
            bias = None if self.bias is None else self.bias[start:stop]
            outputs.append(F.linear(quantized[source], weight[start:stop], bias))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights.describe()}"
        )
