"""A linear layer whose weight stays packed integers in memory (pack-quantized W4A16 / W8A16, and
AWQ's and GPTQ's, read into the same layout: engine/quantization/awq_gptq.py).

Its tensors are the checkpoint's, in compressed-tensors' layout:
  weight_packed      [out, in / pack_factor] int32: the signed integers of each row, offset by
                     2^(bits - 1) to unsigned and packed lowest bits first along the input
  weight_scale       [out, num_groups] in the model's dtype: one per group of inputs
  weight_zero_point  [out / pack_factor, num_groups] int32 (asymmetric, and GPTQ): signed zero
                     points, offset and packed the same way but along the output rows
  g_idx              [in] int32 (GPTQ, while loading): each input's group; where the groups are
                     not in input order (activation order), the inputs are sorted by group once
                     loaded and ``input_order`` [in] holds the order the inputs are gathered in
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


def pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Unsigned ``num_bits``-bit integers [rows, count] (count a multiple of 32 / num_bits)
    packed lowest bits first into [rows, count * num_bits / 32] int32, as compressed-tensors
    packs its (offset) integers: the inverse of ``unpack_int32`` plus the offset."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * num_bits
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    words = (grouped << shifts).sum(dim=-1)  # [rows, words], each in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def packed_int_sizes(
    in_features: int, out_features: int, weights: PackedIntWeights
) -> tuple[int, int]:  # words per row, groups per row
    """The words and groups of each row of a packed [out_features, in_features] weight; raises
    where the inputs do not fill whole words and groups, or (with zero points, packed by rows)
    the outputs whole words."""
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
    if weights.has_zero_points and out_features % pack:
        raise ValueError(
            f"out_features {out_features} of a {weights.num_bits}-bit layer with zero "
            f"points must be a multiple of {pack} (its zero points are packed by rows)"
        )
    return in_features // pack, in_features // group


def dequantize_packed(
    weight_packed: torch.Tensor,  # [out, in / pack] int32
    weight_scale: torch.Tensor,  # [out, num_groups]
    weight_zero_point: torch.Tensor | None,  # [out / pack, num_groups] int32
    num_bits: int,
) -> torch.Tensor:  # [out, in] in the scale's dtype
    """(q - zero) * scale of every weight, in the scale's dtype, as compressed-tensors
    dequantizes: the inputs in the order the words hold them."""
    out_features, words = weight_packed.shape
    in_features = words * (32 // num_bits)
    values = unpack_int32(weight_packed, num_bits, in_features).to(weight_scale.dtype)
    group = in_features // weight_scale.shape[1]
    if weight_zero_point is not None:
        zero = unpack_int32(weight_zero_point.t(), num_bits, out_features).t()
        values = values - zero.to(weight_scale.dtype).repeat_interleave(group, dim=1)
    return values * weight_scale.repeat_interleave(group, dim=1)


_ROWS_PER_PASS = 1024  # output rows whose integers are unpacked at a time to reorder them


class PackedIntLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, weights: PackedIntWeights
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weights = weights
        words, num_groups = packed_int_sizes(in_features, out_features, weights)
        self.weight_packed = nn.Parameter(
            torch.empty(out_features, words, dtype=torch.int32), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, num_groups))
        self.weight_zero_point: nn.Parameter | None = None
        if weights.has_zero_points:
            self.weight_zero_point = nn.Parameter(
                torch.empty(out_features // weights.pack_factor, num_groups, dtype=torch.int32),
                requires_grad=False,
            )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.g_idx: nn.Parameter | None = None  # GPTQ: each input's group, until loaded
        if weights.method == "gptq":
            self.g_idx = nn.Parameter(
                torch.empty(in_features, dtype=torch.int32), requires_grad=False
            )
        self.input_order: nn.Parameter | None = None  # [in]: inputs sorted by group

    def order_inputs_by_group(self, keep_in_order: bool = False) -> None:
        """Drops the loaded ``g_idx`` (each input's group, counted from this rank's first).
        Where it is not the groups in input order (GPTQ's activation order), the weight's inputs
        are sorted by group, and ``input_order`` keeps the order to gather the inputs in.
        ``keep_in_order``: the weights are dummy, their g_idx random; the inputs stay in order."""
        assert self.g_idx is not None, "order_inputs_by_group runs once, after loading"
        g_idx, self.g_idx = self.g_idx.data, None
        group = self.in_features // self.weight_scale.shape[1]
        device = g_idx.device
        in_order = torch.arange(self.in_features, dtype=torch.int32, device=device) // group
        if keep_in_order or torch.equal(g_idx, in_order):
            return
        if not torch.equal(torch.sort(g_idx).values, in_order):
            raise ValueError(
                f"g_idx of a {self.in_features}-input layer does not give each of its "
                f"{self.weight_scale.shape[1]} groups exactly {group} inputs (GPTQ's "
                "quantization_config.desc_act; a tensor-parallel rank of a row-parallel layer "
                "must hold whole groups of its own)"
            )
        order = torch.sort(g_idx, stable=True).indices
        bits = self.weights.num_bits
        for start in range(0, self.out_features, _ROWS_PER_PASS):  # bounded scratch memory
            rows = self.weight_packed.data[start : start + _ROWS_PER_PASS]
            values = unpack_int32(rows, bits, self.in_features) + (1 << (bits - 1))
            rows.copy_(pack_int32(values[:, order], bits))
        self.input_order = nn.Parameter(order, requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] in the scale's dtype
        """The float weight the checkpoint describes, its inputs in the checkpoint's order."""
        weight = dequantize_packed(
            self.weight_packed, self.weight_scale, self.weight_zero_point, self.weights.num_bits
        )  # inputs sorted by group
        if self.input_order is None:
            return weight
        return torch.empty_like(weight).index_copy_(1, self.input_order, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if packed_int_matmul.usable(x):
            if self.input_order is not None:  # the inputs in the order of the weight's
                x = x.index_select(-1, self.input_order)
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
