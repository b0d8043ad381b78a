"""One projection (gate_up or down) of every routed expert of a layer, stacked, its weights kept
as the checkpoint quantized them; dequantized one expert at a time, only for the experts that
have tokens in a step (``QuantizedRoutedExperts`` in engine/models/moe.py).

Two layouts, each the dense layer's (docs/quantized-checkpoints.md) with an expert dimension
first, so expert e's slice is exactly what its checkpoint tensors hold (this rank's rows or
columns of them):
  FP8 blocks     weight            [E, out, in] float8_e4m3fn
  (``fp8``)      weight_scale_inv  [E, ceil(out / block_rows), ceil(in / block_cols)] float32
  packed ints    weight_packed     [E, out, in / pack] int32
  (W4A16/W8A16,  weight_scale      [E, out, num_groups] in the model's dtype
  AWQ, GPTQ)     weight_zero_point [E, out / pack, num_groups] int32 (asymmetric, GPTQ)
                 g_idx             [E, in] int32 (GPTQ, while loading: must be in input order)
A fused gate_up holds each expert's gate rows then its up rows, as the float experts do.

``matmul(expert, rows)`` multiplies by one expert's weight: on CPU (and wherever no kernel
takes the rows) it dequantizes that expert's weight alone, as the dense layers do (FP8 in
float32, packed integers in the scale's dtype) and multiplies in the rows' dtype; on a GPU
the dense layers' Triton kernels run on the expert's slice, reading its quantized tiles
(engine/kernels/packed_int_matmul.py, engine/kernels/fp8_block_matmul.py), one launch per
expert with tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fp8_block_matmul, packed_int_matmul
from engine.quantization.config import Fp8BlockWeights, PackedIntWeights, WeightQuantization
from engine.quantization.packed_linear import dequantize_packed, packed_int_sizes

FP8 = torch.float8_e4m3fn


def dequantize_fp8_blocks(
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(out / block_rows), ceil(in / block_cols)]
    block_rows: int,
    block_cols: int,
) -> torch.Tensor:  # [out, in] float32
    """weight[r, c] * scale[r // block_rows, c // block_cols], in float32."""
    out_features, in_features = weight.shape
    scale = weight_scale_inv.float().repeat_interleave(block_rows, 0)[:out_features]
    scale = scale.repeat_interleave(block_cols, 1)[:, :in_features]
    return weight.float() * scale


class Fp8BlockExpertWeights(nn.Module):
    def __init__(
        self, num_experts: int, in_features: int, out_features: int, weights: Fp8BlockWeights
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.weights = weights
        self.weight = nn.Parameter(
            torch.empty(num_experts, out_features, in_features, dtype=FP8), requires_grad=False
        )
        blocks = (-(-out_features // weights.block_rows), -(-in_features // weights.block_cols))
        self.weight_scale_inv = nn.Parameter(
            torch.empty(num_experts, *blocks, dtype=torch.float32), requires_grad=False
        )

    def keep_quantized_dtypes(self) -> None:
        """Make the weights float8 and the scales float32 again after the model was cast to its
        dtype (``Module.to`` casts every floating tensor)."""
        self.weight = nn.Parameter(self.weight.detach().to(FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            self.weight_scale_inv.detach().float(), requires_grad=False
        )

    def dequantized(self, expert: int) -> torch.Tensor:  # [out, in] float32
        """Expert ``expert``'s float weight."""
        rows, cols = self.weights.block_rows, self.weights.block_cols
        return dequantize_fp8_blocks(self.weight[expert], self.weight_scale_inv[expert], rows, cols)

    def matmul(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [m, in] -> [m, out]
        """``rows`` times expert ``expert``'s weight, transposed."""
        block_size = (self.weights.block_rows, self.weights.block_cols)
        if fp8_block_matmul.usable(rows, block_size):
            return fp8_block_matmul.fp8_block_matmul(
                rows, self.weight[expert], self.weight_scale_inv[expert], block_size
            )
        return F.linear(rows, self.dequantized(expert).to(rows.dtype))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, {self.weights.describe()}"
        )


class PackedIntExpertWeights(nn.Module):
    def __init__(
        self, num_experts: int, in_features: int, out_features: int, weights: PackedIntWeights
    ) -> None:
        super().__init__()
        if weights.act_order:
            raise ValueError(
                "quantization_config.desc_act true (GPTQ's activation order) is not supported "
                "for experts"
            )
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.weights = weights
        words, num_groups = packed_int_sizes(in_features, out_features, weights)
        self.weight_packed = nn.Parameter(
            torch.empty(num_experts, out_features, words, dtype=torch.int32), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(num_experts, out_features, num_groups))
        self.weight_zero_point: nn.Parameter | None = None
        if weights.has_zero_points:
            zero_rows = out_features // weights.pack_factor
            self.weight_zero_point = nn.Parameter(
                torch.empty(num_experts, zero_rows, num_groups, dtype=torch.int32),
                requires_grad=False,
            )
        self.g_idx: nn.Parameter | None = None  # GPTQ: each input's group, until loaded
        if weights.method == "gptq":
            self.g_idx = nn.Parameter(
                torch.empty(num_experts, in_features, dtype=torch.int32), requires_grad=False
            )

    def drop_groups_in_input_order(self, dummy: bool = False) -> None:
        """Drops the loaded ``g_idx`` (GPTQ), after checking every expert's inputs are in
        their groups' order (``i // group_size``); ``dummy``: random weights, not checked."""
        assert self.g_idx is not None, "drop_groups_in_input_order runs once, after loading"
        g_idx, self.g_idx = self.g_idx.data, None
        if dummy:
            return
        group = self.in_features // self.weight_scale.shape[2]
        inputs = torch.arange(self.in_features, dtype=torch.int32, device=g_idx.device)
        in_order = (inputs // group).expand_as(g_idx)
        if not torch.equal(g_idx, in_order):
            raise ValueError(
                "an expert's g_idx is not its inputs' groups in order: experts run GPTQ "
                "checkpoints in input order only (quantization_config.desc_act false)"
            )

    def dequantized(self, expert: int) -> torch.Tensor:  # [out, in] in the scale's dtype
        """Expert ``expert``'s float weight."""
        zero = None if self.weight_zero_point is None else self.weight_zero_point[expert]
        return dequantize_packed(
            self.weight_packed[expert], self.weight_scale[expert], zero, self.weights.num_bits
        )

    def matmul(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [m, in] -> [m, out]
        """``rows`` times expert ``expert``'s weight, transposed."""
        if packed_int_matmul.usable(rows):
            zero = None if self.weight_zero_point is None else self.weight_zero_point[expert]
            return packed_int_matmul.packed_int_matmul(
                rows,
                self.weight_packed[expert],
                self.weight_scale[expert],
                zero,
                self.weights.num_bits,
            )
        return F.linear(rows, self.dequantized(expert).to(rows.dtype))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, {self.weights.describe()}"
        )


ExpertWeights = Fp8BlockExpertWeights | PackedIntExpertWeights
# each stacked layout's tensors that the loader places expert by expert, as the dense layer's
# (engine/model_loader.py)
EXPERT_QUANTIZED_LEAVES = {
    PackedIntExpertWeights: ("weight_packed", "weight_scale", "weight_zero_point", "g_idx"),
    Fp8BlockExpertWeights: ("weight", "weight_scale_inv"),
}


def make_expert_weights(
    num_experts: int, in_features: int, out_features: int, quantization: WeightQuantization
) -> ExpertWeights:
    """One projection of ``num_experts`` experts, stacked, in ``quantization``'s layout: FP8
    blocks or packed integers (the 8-bit W8A8 schemes are refused by the model config)."""
    if isinstance(quantization, Fp8BlockWeights):
        return Fp8BlockExpertWeights(num_experts, in_features, out_features, quantization)
    if isinstance(quantization, PackedIntWeights):
        return PackedIntExpertWeights(num_experts, in_features, out_features, quantization)
    raise ValueError(
        f"quantization_config ({quantization.describe()}) is not supported for experts"
    )
