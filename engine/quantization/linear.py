"""The decoder's projections as the checkpoint holds them: float, packed integers, or FP8."""

from __future__ import annotations

from torch import nn

from engine.quantization.config import Fp8BlockWeights, PackedIntWeights, WeightQuantization
from engine.quantization.fp8_linear import Fp8BlockLinear
from engine.quantization.packed_linear import PackedIntLinear

QuantizedLinear = PackedIntLinear | Fp8BlockLinear
# each quantized layer's tensors that the loader places as its float weight's slices, in
# their own units (engine/model_loader.py)
QUANTIZED_LEAVES = {
    PackedIntLinear: ("weight_packed", "weight_scale", "weight_zero_point"),
    Fp8BlockLinear: ("weight", "weight_scale_inv"),
}


def make_linear(
    in_features: int, out_features: int, bias: bool, quantization: WeightQuantization | None
) -> nn.Linear | QuantizedLinear:
    """A decoder projection: float (``quantization`` None), packed integers or FP8 blocks."""
    if isinstance(quantization, PackedIntWeights):
        return PackedIntLinear(in_features, out_features, bias, quantization)
    if isinstance(quantization, Fp8BlockWeights):
        return Fp8BlockLinear(in_features, out_features, bias, quantization)
    return nn.Linear(in_features, out_features, bias=bias)
