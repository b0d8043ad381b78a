"""A linear layer whose weight stays packed integers in memory (pack-quantized W4A16 / W8A16).

Its tensors are the checkpoint's, in the checkpoint's layout (compressed-tensors):
  weight_packed      [out, in / pack_factor] int32: the signed integers of each row, offset by
                     2^(bits - 1) to unsigned and packed lowest bits first along the input
  weight_scale       [out, num_groups] in the model's dtype: one per group of inputs
  weight_zero_point  [out / pack_factor, num_groups] int32 (asymmetric only): signed zero
                     points, offset and packed the same way but along the output rows
so the loader reads and shards them as it does any weight (rows: output features; columns:
inputs, in words or in groups). The forward dequantizes the weight, (q - zero) * scale, in the
scale's dtype, as compressed-tensors does, and multiplies by it: on CPU this is the correct
path that never holds more than one layer's float weight at a time. On a GPU the Triton kernel
``engine/kernels/packed_int_matmul.py`` does the same tile by tile, the weight never whole in
float: the same rounded weights, another order of the float32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import packed_int_matmul
from engine.quantization.config import PackedIntWeights


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """The first ``count`` signed integers of each row of ``packed`` [rows, words] int32, as
    compressed-tensors packs them: [rows, count] int32."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [rows, words, per_word]
    return values.reshape(packed.shape[0], -1)[:, :count] - (1 << (num_bits - 1))


class PackedIntLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, weights: PackedIntWeights
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weights = weights
        pack = weights.pack_factor
        if in_features % pack:
            raise ValueError(
                f"in_features {in_features} of a {weights.num_bits}-bit packed layer must be a "
                f"multiple of {pack} (quantization_config num_bits)"
            )
        group = weights.group_size or in_features
        if in_features % group:
            raise ValueError(
                f"in_features {in_features} must be a multiple of quantization_config's "
                f"group_size {group}"
            )
        num_groups = in_features // group
        self.weight_packed = nn.Parameter(
            torch.empty(out_features, in_features // pack, dtype=torch.int32), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, num_groups))
        self.weight_zero_point: nn.Parameter | None = None
        if not weights.symmetric:
            if out_features % pack:
                raise ValueError(
                    f"out_features {out_features} of an asymmetric {weights.num_bits}-bit "
                    f"layer must be a multiple of {pack} (its zero points are packed by rows)"
                )
            self.weight_zero_point = nn.Parameter(
                torch.empty(out_features // pack, num_groups, dtype=torch.int32),
                requires_grad=False,
            )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] in the scale's dtype
        bits, scale = self.weights.num_bits, self.weight_scale
        values = unpack_int32(self.weight_packed, bits, self.in_features).to(scale.dtype)
        group = self.in_features // scale.shape[1]
        if self.weight_zero_point is not None:
            zero = unpack_int32(self.weight_zero_point.t(), bits, self.out_features).t()
            values = values - zero.to(scale.dtype).repeat_interleave(group, dim=1)
        return values * scale.repeat_interleave(group, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if packed_int_matmul.usable(x):
            out = packed_int_matmul.packed_int_matmul(
                x.reshape(-1, self.in_features),
                self.weight_packed,
                self.weight_scale,
                self.weight_zero_point,
                self.weights.num_bits,
                self.bias,
            )  # [num_rows, out_features]
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights.describe()}"
        )
