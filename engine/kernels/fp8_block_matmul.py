"""Triton kernels: x @ W.T for a block-scaled float8 weight (``quant_method: fp8``, DeepSeek-V3's
and Qwen3's FP8 checkpoints), the inputs quantized to float8 per token and group as they
arrive, as DeepSeek-V3 runs these layers (vLLM's and SGLang's ``per_token_group_quant_fp8``
then ``w8a8_block_fp8_matmul``).

The weight's layout (engine/quantization/fp8_linear.py): ``weight`` [out, in] float8_e4m3fn
and ``weight_scale_inv`` [ceil(out / block_rows), ceil(in / block_cols)] float32, so that
W[n, k] = weight[n, k] * weight_scale_inv[n // block_rows, k // block_cols].

1. ``_group_quantize_kernel`` (``quantize_per_token_group``): one program per row of x and
   group of ``block_cols`` inputs (the last group of a row may be shorter). In float32: the
   group's largest magnitude, at least 1e-10; scale = largest / 448; each input x / scale
   (IEEE division, as torch divides; a plain ``/`` compiles to an approximate one), clamped
   to +-448 and rounded to the nearest e4m3 value, ties to even (in integer arithmetic, as
   the KV cache write rounds: Triton's interpreter's cast rounds ties up).
2. ``_fp8_block_matmul_kernel`` (``fp8_block_matmul``): a program takes ``BLOCK_M`` rows and
   ``BLOCK_N`` outputs and steps over the inputs ``BLOCK_K`` at a time, a step inside one
   group (``BLOCK_K`` divides ``block_cols``): the step's float8 dot (a tensor-core MMA),
   times each row's scale of the group and each output's scale of its block, joins a float32
   accumulator. The MMA's own sum thus spans at most one group, the precision DeepSeek-V3
   promotes its float8 sums at. The bias joins the float32 sum before its one rounding to
   x's dtype.

The result is the exact product of the quantized inputs and the weight up to float32 sums; the
torch path on CPU (``Fp8BlockLinear``'s) does not quantize the inputs, so the two differ by
the inputs' float8 rounding (a relative 2^-4 at most an input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import FLOAT_DTYPES, require, require_bias, require_same_device
from engine.kernels.kv_cache_write import to_float8e4nv
from engine.kernels.matmul_tiling import (
    MIN_DOT_DIM,
    MIN_DOT_K_8BIT,
    MatmulTiling,
    check_tiling_8bit,
)

FP8_MAX = 448.0  # e4m3's largest finite magnitude
GROUP_EPS = 1e-10  # the least largest magnitude of a group (a group of zeros' scale > 0)
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_GROUP_EPS: tl.constexpr = tl.constexpr(GROUP_EPS)
_MAX_BLOCK_K = 128
_MAX_BLOCK_M = 64
_DECODE_ROWS = 16  # up to this many rows: a decode step's tiles


def default_tiling(num_rows: int, block_cols: int) -> MatmulTiling:
    """K steps of a group (up to 128 inputs); a decode step (<= 16 rows): 16-row tiles, 64
    outputs; a prefill: tiles as tall as the rows (up to 64), 128 outputs."""
    block_k = min(_MAX_BLOCK_K, block_cols)
    if num_rows <= _DECODE_ROWS:
        return MatmulTiling(block_m=MIN_DOT_DIM, block_n=64, block_k=block_k, num_stages=4)
    block_m = min(_MAX_BLOCK_M, triton.next_power_of_2(num_rows))
    return MatmulTiling(block_m=block_m, block_n=128, block_k=block_k)


def block_cols_supported(block_cols: int) -> bool:
    """The kernels take groups of ``block_cols`` inputs: a power of two >= 32."""
    return block_cols >= MIN_DOT_K_8BIT and block_cols & (block_cols - 1) == 0


def usable(x: torch.Tensor, block_size: tuple[int, int]) -> bool:
    """The kernels take ``x`` and a weight in blocks of ``block_size`` (rows, columns): a float
    tensor on a CUDA device, and columns a power of two >= 32 (DeepSeek-V3's 128)."""
    return x.is_cuda and x.dtype in FLOAT_DTYPES and block_cols_supported(block_size[1])


@triton.jit
def _group_quantize_kernel(
    x_ptr,  # [num_rows, num_cols] float
    q_ptr,  # [num_rows, num_cols] float8e4nv, contiguous
    scale_ptr,  # [num_rows, num_groups] float32, contiguous
    num_cols,
    num_groups,
    x_stride_row,
    x_stride_col,
    GROUP: tl.constexpr,  # inputs a scale covers (a power of two)
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_stride_row + cols * x_stride_col, mask=mask, other=0.0)
    x = x.to(tl.float32)
    largest = tl.maximum(tl.max(tl.abs(x), axis=0), _GROUP_EPS)
    scale = tl.math.div_rn(largest, _FP8_MAX)
    q = to_float8e4nv(tl.math.div_rn(x, scale))
    tl.store(q_ptr + row * num_cols + cols, q, mask=mask)
    tl.store(scale_ptr + row * num_groups + group, scale)


@triton.jit
def _fp8_block_matmul_kernel(
    a_ptr,  # [num_rows, in_features] float8e4nv, contiguous: the quantized x
    a_scale_ptr,  # [num_rows, num_groups] float32, contiguous
    b_ptr,  # [out_features, in_features] float8e4nv, rows contiguous: the weight
    b_scale_ptr,  # [ceil(out_features / block_rows), num_groups] float
    bias_ptr,  # [out_features] float (read only when HAS_BIAS)
    out_ptr,  # [num_rows, out_features], contiguous
    num_rows,
    out_features,
    in_features,
    num_groups,
    block_rows,
    b_stride_row,
    b_scale_stride_row,
    b_scale_stride_col,
    GROUP: tl.constexpr,  # inputs a scale covers: a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of the outputs
    row_mask = rows < num_rows
    col_mask = cols < out_features
    # the outputs on the MMA's M side (sm_90's float8 MMA takes 64 a warpgroup) and the rows
    # on its N side, so a decode step's few rows run it too: acc is [BLOCK_N, BLOCK_M]
    w_cols = b_ptr + cols.to(tl.int64)[:, None] * b_stride_row  # [BLOCK_N, 1]
    x_rows = a_ptr + rows.to(tl.int64)[None, :] * in_features  # [1, BLOCK_M]
    w_scale_cols = b_scale_ptr + (cols // block_rows) * b_scale_stride_row  # [BLOCK_N]
    x_scale_rows = a_scale_ptr + rows.to(tl.int64) * num_groups  # [BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < in_features
        w_mask = col_mask[:, None] & k_mask[None, :]  # [BLOCK_N, BLOCK_K]
        w = tl.load(w_cols + ks[None, :], mask=w_mask, other=0.0)
        x_mask = k_mask[:, None] & row_mask[None, :]  # [BLOCK_K, BLOCK_M]
        x = tl.load(x_rows + ks[:, None], mask=x_mask, other=0.0)
        group = k_start // GROUP
        w_scale = tl.load(w_scale_cols + group * b_scale_stride_col, mask=col_mask, other=0.0)
        x_scale = tl.load(x_scale_rows + group, mask=row_mask, other=0.0)
        acc += tl.dot(w, x) * w_scale.to(tl.float32)[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    out_offsets = rows.to(tl.int64)[None, :] * out_features + cols[:, None]
    out_mask = col_mask[:, None] & row_mask[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def quantize_per_token_group(
    x: torch.Tensor,  # [num_rows, in_features] float
    group_size: int,  # a power of two >= 32
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_rows, in] float8_e4m3fn, [num_rows, groups] f32
    """Each row of ``x`` quantized to float8 e4m3 in groups of ``group_size`` inputs, a scale
    per row and group (module docstring), so that ``q * scale`` approximates x. Raises
    ValueError naming the argument on a wrong shape, dtype or device."""
    require(x.dim() == 2, f"x must be [num_rows, in_features], got {list(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    require(
        block_cols_supported(group_size),
        f"group_size must be a power of two >= {MIN_DOT_K_8BIT}, got {group_size}",
    )
    require_same_device(x, "x")
    num_rows, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, group_size)
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return q, scale
    _group_quantize_kernel[(num_rows, num_groups)](
        x,
        q,
        scale,
        num_cols,
        num_groups,
        x.stride(0),
        x.stride(1),
        GROUP=group_size,
        num_warps=1 if group_size <= 256 else 4,
    )
    return q, scale


def fp8_block_matmul(
    x: torch.Tensor,  # [num_rows, in_features] float
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(out / block_rows), ceil(in / block_cols)] float
    block_size: tuple[int, int],  # (block_rows, block_cols): weight_block_size
    bias: torch.Tensor | None = None,  # [out_features] float
    tiling: MatmulTiling | None = None,
) -> torch.Tensor:  # [num_rows, out_features] of x's dtype
    """x @ W.T (+ bias), W the block-dequantized weight and x quantized per token and group of
    ``block_cols`` inputs (module docstring). Raises ValueError naming the argument on a wrong
    shape, dtype or device, or a block or tiling the kernels cannot run."""
    block_rows, block_cols = block_size
    _check(x, weight, weight_scale_inv, block_size, bias)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if tiling is None:
        tiling = default_tiling(num_rows, block_cols)
    check_tiling_8bit(tiling)
    require(
        block_cols % tiling.block_k == 0,
        f"tiling.block_k {tiling.block_k} must divide block_size[1] {block_cols} (a K step "
        "inside one group)",
    )
    out = x.new_empty(num_rows, out_features)
    if num_rows == 0 or out_features == 0:
        return out
    x_q, x_scale = quantize_per_token_group(x, block_cols)
    grid = (triton.cdiv(num_rows, tiling.block_m), triton.cdiv(out_features, tiling.block_n))
    _fp8_block_matmul_kernel[grid](
        x_q,
        x_scale,
        weight,
        weight_scale_inv,
        bias if bias is not None else out,  # (not read without a bias)
        out,
        num_rows,
        out_features,
        in_features,
        x_scale.shape[1],
        block_rows,
        weight.stride(0),
        weight_scale_inv.stride(0),
        weight_scale_inv.stride(1),
        GROUP=block_cols,
        HAS_BIAS=bias is not None,
        **tiling.launch_options(),
    )
    return out


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None,
) -> None:
    require(x.dim() == 2, f"x must be [num_rows, in_features], got {list(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    block_rows, block_cols = block_size
    require(block_rows >= 1, f"block_size[0] (rows a scale covers) must be >= 1, got {block_rows}")
    require(
        block_cols_supported(block_cols),
        f"block_size[1] (inputs a scale covers) must be a power of two >= {MIN_DOT_K_8BIT}, "
        f"got {block_cols}",
    )
    in_features = x.shape[1]
    require(
        weight.dim() == 2 and weight.shape[1] == in_features,
        f"weight must be [out_features, in_features = {in_features}], got {list(weight.shape)}",
    )
    require(
        weight.dtype == torch.float8_e4m3fn,
        f"weight must be float8_e4m3fn, got {weight.dtype}",
    )
    require(weight.stride(1) == 1, f"weight's rows must be contiguous, got {weight.stride()}")
    out_features = weight.shape[0]
    scale_shape = (triton.cdiv(out_features, block_rows), triton.cdiv(in_features, block_cols))
    require(
        tuple(weight_scale_inv.shape) == scale_shape,
        f"weight_scale_inv must be [ceil(out_features / {block_rows}), ceil(in_features / "
        f"{block_cols})] = {list(scale_shape)}, got {list(weight_scale_inv.shape)}",
    )
    require(
        weight_scale_inv.dtype in FLOAT_DTYPES,
        f"weight_scale_inv dtype must be one of {FLOAT_DTYPES}, got {weight_scale_inv.dtype}",
    )
    tensors = {"weight": weight, "weight_scale_inv": weight_scale_inv}
    if bias is not None:
        require_bias(bias, out_features)
        tensors["bias"] = bias
    require_same_device(x, "x", **tensors)
