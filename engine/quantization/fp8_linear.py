"""A linear layer whose weight stays float8 e4m3 in memory, scaled per block (``quant_method:
fp8``, DeepSeek-V3's and Qwen3's FP8 checkpoints).

Its tensors are the checkpoint's: ``weight`` [out, in] float8_e4m3fn and ``weight_scale_inv``
[ceil(out / block_rows), ceil(in / block_cols)] float32, so that weight[r, c] * scale[r //
block_rows, c // block_cols] is the float weight. The loader reads and shards them as any
weight (the scales in blocks: a tensor-parallel slice must fall on whole blocks). On CPU the
forward dequantizes the weight in float32 and multiplies in the activations' dtype, as
transformers runs these checkpoints on CPU. On a GPU the Triton kernels of
``engine/kernels/fp8_block_matmul.py`` run it as DeepSeek-V3 does: the inputs quantized to
float8 per token and group of ``block_cols`` inputs, a float8 matmul per group, scaled by the
inputs' and the weight block's scales (block columns a power of two >= 32; other blocks keep
the dequantizing path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fp8_block_matmul
from engine.quantization.config import Fp8BlockWeights

FP8 = torch.float8_e4m3fn


class Fp8BlockLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, weights: Fp8BlockWeights
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weights = weights
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        scale_shape = (
            -(-out_features // weights.block_rows),
            -(-in_features // weights.block_cols),
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def keep_quantized_dtypes(self) -> None:
        """Make the weight float8 and the scales float32 again after the model was cast to its
        dtype (``Module.to`` casts every floating tensor)."""
        self.weight = nn.Parameter(self.weight.detach().to(FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            self.weight_scale_inv.detach().float(), requires_grad=False
        )

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        rows, cols = self.weights.block_rows, self.weights.block_cols
        scale = self.weight_scale_inv.repeat_interleave(rows, 0)[: self.out_features]
        scale = scale.repeat_interleave(cols, 1)[:, : self.in_features]
        return self.weight.float() * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block_size = (self.weights.block_rows, self.weights.block_cols)
        if fp8_block_matmul.usable(x, block_size):
            out = fp8_block_matmul.fp8_block_matmul(
                x.reshape(-1, self.in_features),
                self.weight,
                self.weight_scale_inv,
                block_size,
                self.bias,
            )  # [num_rows, out_features]
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights.describe()}"
        )
