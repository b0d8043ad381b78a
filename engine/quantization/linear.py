"""The decoder's projections as the checkpoint holds them: float, packed integers, FP8 blocks,
or 8-bit weights with 8-bit inputs (per token or static)."""

from __future__ import annotations

from torch import nn

from engine.parallel.group import TensorParallelGroup
from engine.quantization.config import (
    Fp8BlockWeights,
    PackedIntWeights,
    W8A8Weights,
    WeightQuantization,
)
from engine.quantization.fp8_linear import Fp8BlockLinear
from engine.quantization.packed_linear import PackedIntLinear
from engine.quantization.w8a8_linear import W8A8Linear

QuantizedLinear = PackedIntLinear | Fp8BlockLinear | W8A8Linear
# each quantized layer's tensors that the loader places as its float weight's slices, in
# their own units (engine/model_loader.py)
QUANTIZED_LEAVES = {
    PackedIntLinear: ("weight_packed", "weight_scale", "weight_zero_point", "g_idx"),
    Fp8BlockLinear: ("weight", "weight_scale_inv"),
    W8A8Linear: ("weight", "weight_scale", "input_scale"),
}


def make_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    quantization: WeightQuantization | None,
    row_group: TensorParallelGroup | None = None,
) -> nn.Linear | QuantizedLinear:
    """A decoder projection: float (``quantization`` None, or one that quantizes the routed
    experts alone: MXFP4), packed integers, FP8 blocks or 8-bit weights with 8-bit inputs.
    ``row_group``: the ranks a row-parallel projection's inputs are split over (its dynamic
    per-token input scales are the whole row's)."""
    if isinstance(quantization, PackedIntWeights):
        return PackedIntLinear(in_features, out_features, bias, quantization)
    if isinstance(quantization, Fp8BlockWeights):
        return Fp8BlockLinear(in_features, out_features, bias, quantization)
    if isinstance(quantization, W8A8Weights):
        return W8A8Linear(in_features, out_features, bias, quantization, row_group)
    return nn.Linear(in_features, out_features, bias=bias)
