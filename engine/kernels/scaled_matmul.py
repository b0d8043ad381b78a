"""Triton kernels: x @ W.T for W8A8 layers (compressed-tensors' int8 W8A8, FP8_DYNAMIC and
FP8), the inputs quantized as they arrive, both operands 8-bit in the matmul.

The weight's layout (engine/quantization/w8a8_linear.py): ``weight`` [out, in] int8 or
float8_e4m3fn and ``weight_scale`` [out, 1], so W[n, k] = weight[n, k] * weight_scale[n].

1. ``_quantize_rows_kernel`` (``quantize_rows``): one program per row of x, which quantizes the
   row as ``w8a8_linear`` does, to the bit. Per token (``quantize_per_token``), every step in
   x's dtype, that is float32 arithmetic (IEEE division) rounded to x's dtype, nearest even,
   after each step: the row's largest magnitude (or a given one: a row-parallel layer's ranks
   share it), scale = largest / half range (127.5 for int8, compressed-tensors' (127 - -128)
   / 2; 448 for float8), a zero scale replaced by x's dtype's eps. Or a static scale
   (``quantize_with_scale``), in the dtype torch promotes x and the scale to. Then x / scale,
   clamped to the type's range (int8 [-128, 127], float8 +-448) and rounded to the nearest
   integer or e4m3 value, ties to even. The rounding to bfloat16 and to e4m3 is done in
   integer and float32 arithmetic, not by Triton's casts: its interpreter's float32 ->
   bfloat16 cast truncates and its float32 -> float8e4nv cast rounds ties up, where a GPU
   rounds to nearest even. The scale is stored as float32 (the value it is in its dtype).
2. ``_scaled_matmul_kernel`` (``scaled_matmul``): a program takes ``BLOCK_M`` rows and
   ``BLOCK_N`` outputs and steps over the inputs ``BLOCK_K`` at a time, each step one
   tensor-core dot of the 8-bit tiles: int8 into an int32 accumulator (exact), float8 into a
   float32 one (promoted to full float32 precision once per step on sm_90, whose float8 MMA
   accumulates with fewer mantissa bits). Its epilogue scales the sum in float32, sum *
   x_scale[m] * weight_scale[n], adds the bias, and rounds once to the output dtype.

On sm_90 a float8 matmul with a bfloat16 output runs torch's ``_scaled_mm`` (cuBLAS / CUTLASS
with a scale per row of x and per row of W) instead of the Triton kernel, which stays the
path for int8, other GPUs and other dtypes.

So a GPU result is the exact product of the quantized operands, scaled: the torch path's
quantized inputs, but without its rounding of each dequantized input and weight to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import FLOAT_DTYPES, require, require_bias, require_same_device
from engine.kernels.kv_cache_write import to_float8e4nv
from engine.kernels.matmul_tiling import MIN_DOT_DIM, MatmulTiling, check_tiling_8bit

KINDS = ("int", "float")  # W8A8Weights.kind: int8, float8 e4m3
ELEMENT_DTYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}
_MAX_BLOCK_M = 64
_DECODE_ROWS = 16  # up to this many rows: a decode step's tiles
_MAX_QUANTIZE_BLOCK = 4096  # inputs a quantizing program reads at a time
# float32 x + 1.5 * 2^23 has no fraction bits left for |x| <= 2^22: the addition rounds x to an
# integer, half to even
_ROUND_TO_INTEGER: tl.constexpr = tl.constexpr(12582912.0)


def default_tiling(num_rows: int) -> MatmulTiling:
    """A decode step (<= 16 rows): 16-row tiles, 64 outputs; a prefill: tiles as tall as the
    rows (up to 64), 128 outputs. K steps of 128 inputs (128 bytes of each row) either way."""
    if num_rows <= _DECODE_ROWS:
        return MatmulTiling(block_m=MIN_DOT_DIM, block_n=64, block_k=128, num_stages=4)
    block_m = min(_MAX_BLOCK_M, triton.next_power_of_2(num_rows))
    return MatmulTiling(block_m=block_m, block_n=128, block_k=128)


def usable(x: torch.Tensor) -> bool:
    """The kernels take ``x``: a float tensor on a CUDA device."""
    return x.is_cuda and x.dtype in FLOAT_DTYPES


def torch_scaled_mm_usable(x_q: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """torch's ``_scaled_mm`` takes this float8 matmul with a scale per row of each operand:
    on sm_90 (Hopper), with a bfloat16 output and the inputs and outputs multiples of 16."""
    return (
        x_q.is_cuda
        and x_q.dtype == torch.float8_e4m3fn
        and out_dtype == torch.bfloat16
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(x_q.device)[0] == 9
        and x_q.shape[1] % 16 == 0
        and weight.shape[0] % 16 == 0
        and x_q.is_contiguous()
        and weight.is_contiguous()
    )


@triton.jit
def _round_to(value, dtype: tl.constexpr):
    """float32 ``value`` rounded to ``dtype`` (nearest, ties to even), as float32."""
    if dtype == tl.bfloat16:  # drop the 16 low bits, rounding to nearest even
        bits = value.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return value.to(tl.float16).to(tl.float32)
    else:
        return value


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [num_rows, num_cols] float
    given_ptr,  # [num_rows] largest magnitudes of x's dtype, or [1] a static scale (if given)
    q_ptr,  # [num_rows, num_cols] int8 or float8e4nv, contiguous
    scale_ptr,  # [num_rows] float32
    num_cols,
    x_stride_row,
    x_stride_col,
    given_stride,
    zero_scale,  # x's dtype's eps: the scale of a row of zeros
    IS_INT: tl.constexpr,
    GIVEN: tl.constexpr,  # "largest": each row's largest magnitude; "scale": the scale; "": none
    ROUND_TO_X: tl.constexpr,  # each step rounds to x's dtype (else it stays float32)
    BLOCK: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty if ROUND_TO_X else tl.float32
    HALF_RANGE: tl.constexpr = 127.5 if IS_INT else 448.0
    LOW: tl.constexpr = -128.0 if IS_INT else -448.0
    HIGH: tl.constexpr = 127.0 if IS_INT else 448.0
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride_row
    q_row = q_ptr + row * num_cols
    if GIVEN == "scale":
        scale = tl.load(given_ptr).to(tl.float32)
    else:
        if GIVEN == "largest":
            largest = tl.load(given_ptr + row * given_stride).to(tl.float32)
        else:
            largest = tl.full((), 0.0, tl.float32)
            for start in range(0, num_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols * x_stride_col, mask=cols < num_cols, other=0.0)
                largest = tl.maximum(largest, tl.max(tl.abs(x.to(tl.float32)), axis=0))
        scale = _round_to(tl.math.div_rn(largest, HALF_RANGE), DTYPE)
        scale = tl.where(scale == 0.0, zero_scale, scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_row + cols * x_stride_col, mask=mask, other=0.0).to(tl.float32)
        scaled = _round_to(tl.math.div_rn(x, scale), DTYPE)
        scaled = tl.minimum(tl.maximum(scaled, LOW), HIGH)
        if IS_INT:
            q = ((scaled + _ROUND_TO_INTEGER) - _ROUND_TO_INTEGER).to(tl.int8)
        else:
            q = to_float8e4nv(scaled)
        tl.store(q_row + cols, q, mask=mask)


@triton.jit
def _scaled_matmul_kernel(
    a_ptr,  # [num_rows, in_features] int8 or float8e4nv, rows contiguous: the quantized x
    a_scale_ptr,  # [num_rows] float32
    b_ptr,  # [out_features, in_features] of a's type, rows contiguous: the weight
    b_scale_ptr,  # [out_features] float
    bias_ptr,  # [out_features] float (read only when HAS_BIAS)
    out_ptr,  # [num_rows, out_features], contiguous
    num_rows,
    out_features,
    in_features,
    a_stride_row,
    b_stride_row,
    a_scale_stride,
    b_scale_stride,
    IS_INT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # a float8 MMA's partial sums join the float32 accumulator once a K step (sm_90 sums them
    # with fewer mantissa bits); int8 sums are exact
    MAX_IMPRECISE: tl.constexpr = 0 if IS_INT else BLOCK_K
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of the outputs
    row_mask = rows < num_rows
    col_mask = cols < out_features
    # the outputs on the MMA's M side (sm_90's 8-bit MMA takes 64 a warpgroup) and the rows on
    # its N side, so a decode step's few rows run it too: acc is [BLOCK_N, BLOCK_M]
    w_cols = b_ptr + cols.to(tl.int64)[:, None] * b_stride_row  # [BLOCK_N, 1]
    x_rows = a_ptr + rows.to(tl.int64)[None, :] * a_stride_row  # [1, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.int32 if IS_INT else tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < in_features
        w_mask = col_mask[:, None] & k_mask[None, :]  # [BLOCK_N, BLOCK_K]
        w = tl.load(w_cols + ks[None, :], mask=w_mask, other=0.0)
        x_mask = k_mask[:, None] & row_mask[None, :]  # [BLOCK_K, BLOCK_M]
        x = tl.load(x_rows + ks[:, None], mask=x_mask, other=0.0)
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=MAX_IMPRECISE)
    w_scale = tl.load(b_scale_ptr + cols * b_scale_stride, mask=col_mask, other=0.0)
    x_scale = tl.load(a_scale_ptr + rows * a_scale_stride, mask=row_mask, other=0.0)
    out = acc.to(tl.float32) * w_scale.to(tl.float32)[:, None] * x_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    out_offsets = rows.to(tl.int64)[None, :] * out_features + cols[:, None]
    out_mask = col_mask[:, None] & row_mask[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def quantize_rows(
    x: torch.Tensor,  # [num_rows, in_features] float
    kind: str,  # "int": int8; "float": float8 e4m3
    row_largest: torch.Tensor | None = None,  # [num_rows, 1] of x's dtype
    input_scale: torch.Tensor | None = None,  # [1] float: a static input scale
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_rows, in_features] 8-bit, [num_rows, 1] float32
    """Each row of ``x`` quantized, the 8-bit values and each row's scale, so that ``q *
    scale`` is what ``w8a8_linear`` computes in x's dtype (module docstring):
    - by default with a scale of its own, as ``quantize_per_token``;
    - ``row_largest``: with the scale of its largest magnitude over every rank holding some
      of its features (a row-parallel layer's), as ``quantize_per_token`` with a row group;
    - ``input_scale``: with a static scale, as ``quantize_with_scale(x, input_scale)``, in
      the dtype torch computes that in (x's, or float32 where the scale's dtype differs).
    Raises ValueError naming the argument on a wrong shape, dtype or device."""
    _check_x(x, kind)
    num_rows, num_cols = x.shape
    require(
        row_largest is None or input_scale is None,
        "row_largest is for per-token scales, input_scale a static one: give one at most",
    )
    mode, given = "", x  # (x: not read)
    if row_largest is not None:
        require(
            tuple(row_largest.shape) == (num_rows, 1) and row_largest.dtype == x.dtype,
            f"row_largest must be [num_rows = {num_rows}, 1] of x's dtype {x.dtype}, got "
            f"{list(row_largest.shape)} {row_largest.dtype}",
        )
        mode, given = "largest", row_largest
        require_same_device(x, "x", row_largest=row_largest)
    if input_scale is not None:
        require(
            input_scale.numel() == 1 and input_scale.dtype in FLOAT_DTYPES,
            f"input_scale must be one float, got {list(input_scale.shape)} {input_scale.dtype}",
        )
        mode, given = "scale", input_scale.reshape(1)
        require_same_device(x, "x", input_scale=input_scale)
    compute_dtype = x.dtype if input_scale is None else torch.result_type(x, input_scale)
    q = torch.empty(num_rows, num_cols, dtype=ELEMENT_DTYPES[kind], device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block = min(_MAX_QUANTIZE_BLOCK, triton.next_power_of_2(max(num_cols, 1)))
    _quantize_rows_kernel[(num_rows,)](
        x,
        given,
        q,
        scale,
        num_cols,
        x.stride(0),
        x.stride(1),
        given.stride(0),
        torch.finfo(x.dtype).eps,
        IS_INT=kind == "int",
        GIVEN=mode,
        ROUND_TO_X=compute_dtype == x.dtype,
        BLOCK=block,
        num_warps=4 if block >= 1024 else 1,
    )
    return q, scale


def scaled_matmul(
    x_q: torch.Tensor,  # [num_rows, in_features] int8 or float8_e4m3fn
    x_scale: torch.Tensor,  # [num_rows, 1] float32
    weight: torch.Tensor,  # [out_features, in_features] of x_q's dtype
    weight_scale: torch.Tensor,  # [out_features, 1] float
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [out_features] float
    tiling: MatmulTiling | None = None,
    allow_torch: bool = True,
) -> torch.Tensor:  # [num_rows, out_features] of out_dtype
    """(x_q @ weight.T) * x_scale * weight_scale.T (+ bias), the sum exact (int8) or in float32
    (float8), rounded once to ``out_dtype``. ``allow_torch``: a float8 matmul may run torch's
    ``_scaled_mm`` where it can (``torch_scaled_mm_usable``); False: always the Triton kernel.
    Raises ValueError naming the argument on a wrong shape, dtype or device."""
    _check_matmul(x_q, x_scale, weight, weight_scale, out_dtype, bias)
    num_rows, in_features = x_q.shape
    out_features = weight.shape[0]
    if allow_torch and tiling is None and torch_scaled_mm_usable(x_q, weight, out_dtype):
        return torch._scaled_mm(
            x_q,
            weight.t(),  # [in, out], column-major
            scale_a=x_scale.contiguous(),
            scale_b=weight_scale.float().reshape(1, out_features),
            bias=bias.to(out_dtype) if bias is not None else None,
            out_dtype=out_dtype,
        )
    if tiling is None:
        tiling = default_tiling(num_rows)
    check_tiling_8bit(tiling)
    out = torch.empty(num_rows, out_features, dtype=out_dtype, device=x_q.device)
    if num_rows == 0 or out_features == 0:
        return out
    grid = (triton.cdiv(num_rows, tiling.block_m), triton.cdiv(out_features, tiling.block_n))
    _scaled_matmul_kernel[grid](
        x_q,
        x_scale,
        weight,
        weight_scale,
        bias if bias is not None else out,  # (not read without a bias)
        out,
        num_rows,
        out_features,
        in_features,
        x_q.stride(0),
        weight.stride(0),
        x_scale.stride(0),
        weight_scale.stride(0),
        IS_INT=x_q.dtype == torch.int8,
        HAS_BIAS=bias is not None,
        **tiling.launch_options(),
    )
    return out


def w8a8_matmul(
    x: torch.Tensor,  # [num_rows, in_features] float
    weight: torch.Tensor,  # [out_features, in_features] int8 or float8_e4m3fn
    weight_scale: torch.Tensor,  # [out_features, 1] float
    kind: str,  # "int" or "float": W8A8Weights.kind, the weight's type
    bias: torch.Tensor | None = None,  # [out_features] float
    row_largest: torch.Tensor | None = None,  # [num_rows, 1] of x's dtype (row-parallel)
    input_scale: torch.Tensor | None = None,  # [1] float: a static input scale
    tiling: MatmulTiling | None = None,
) -> torch.Tensor:  # [num_rows, out_features] of x's dtype
    """A W8A8 layer's forward on a GPU: x quantized per token, or with a static scale
    (``quantize_rows``), then the 8-bit matmul scaled per token and per output
    (``scaled_matmul``), in x's dtype."""
    _check_x(x, kind)
    require(
        weight.dtype == ELEMENT_DTYPES[kind],
        f"weight must be {ELEMENT_DTYPES[kind]} for kind {kind!r}, got {weight.dtype}",
    )
    x_q, x_scale = quantize_rows(x, kind, row_largest, input_scale)
    return scaled_matmul(x_q, x_scale, weight, weight_scale, x.dtype, bias, tiling)


def _check_x(x: torch.Tensor, kind: str) -> None:
    require(kind in KINDS, f"kind must be one of {KINDS}, got {kind!r}")
    require(x.dim() == 2, f"x must be [num_rows, in_features], got {list(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    require_same_device(x, "x")


def _check_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> None:
    elements = tuple(ELEMENT_DTYPES.values())
    require(x_q.dim() == 2, f"x_q must be [num_rows, in_features], got {list(x_q.shape)}")
    require(x_q.dtype in elements, f"x_q dtype must be one of {elements}, got {x_q.dtype}")
    num_rows, in_features = x_q.shape
    require(
        tuple(x_scale.shape) == (num_rows, 1) and x_scale.dtype == torch.float32,
        f"x_scale must be float32 [num_rows = {num_rows}, 1], got {list(x_scale.shape)} "
        f"{x_scale.dtype}",
    )
    require(
        weight.dim() == 2 and weight.shape[1] == in_features,
        f"weight must be [out_features, in_features = {in_features}], got {list(weight.shape)}",
    )
    require(weight.dtype == x_q.dtype, f"weight dtype {weight.dtype} != x_q's {x_q.dtype}")
    for name, tensor in (("x_q", x_q), ("weight", weight)):
        require(tensor.stride(1) == 1, f"{name}'s rows must be contiguous, got {tensor.stride()}")
    out_features = weight.shape[0]
    require(
        tuple(weight_scale.shape) == (out_features, 1) and weight_scale.dtype in FLOAT_DTYPES,
        f"weight_scale must be a float [out_features = {out_features}, 1], got "
        f"{list(weight_scale.shape)} {weight_scale.dtype}",
    )
    require(out_dtype in FLOAT_DTYPES, f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    tensors = {"x_scale": x_scale, "weight": weight, "weight_scale": weight_scale}
    if bias is not None:
        require_bias(bias, out_features)
        tensors["bias"] = bias
    require_same_device(x_q, "x_q", **tensors)
