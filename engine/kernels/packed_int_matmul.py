"""Triton kernel: x @ W.T for a weight held as packed integers (compressed-tensors'
pack-quantized W4A16 / W8A16), dequantized tile by tile in registers, never whole in memory.

The weight's layout (docs/quantized-checkpoints.md section 3):
  weight_packed      [out, in / pack] int32, pack = 32 / bits: input k of row n is bits
                     ``(k % pack) * bits ..`` of word ``k // pack``, the signed integer offset
                     by 2^(bits - 1)
  weight_scale       [out, num_groups] float: inputs ``g * group .. (g + 1) * group`` of a row
                     share scale ``g`` (group = in / num_groups; one group: per channel)
  weight_zero_point  [out / pack, num_groups] int32 (asymmetric only): signed zero points,
                     offset and packed the same way but along the output rows
and W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // group.

A program takes ``BLOCK_M`` rows of x and ``BLOCK_N`` outputs, and steps over the inputs
``BLOCK_K`` at a time: it loads the step's ``BLOCK_K / pack`` words of each output once,
repeats each word for its ``pack`` inputs in registers (a broadcast and a reshape), shifts and
masks out each input's bits, subtracts the zero point, multiplies by the scale, and takes the
tile's dot with x's tile into a float32 accumulator. The offsets 2^(bits - 1) of q and zero
cancel, so an asymmetric weight is the unsigned bits' difference, a symmetric one the bits
minus the offset. When a K tile lies inside one group (``group % BLOCK_K == 0``, or one group
per row) its scales and zero points are one row of ``BLOCK_N`` values; otherwise (groups
smaller than a tile, or not dividing it) each input looks up its own group.

Each weight rounds where ``PackedIntLinear.dequantized_weight`` rounds it: (q - zero) is an
exact integer, its product with the scale rounds to the scale's dtype, and that rounds to x's
dtype; so the kernel's weights are the torch path's bits, and its results differ from the torch
path's matmul only by the order of the float32 sums. The bias joins the float32 sum before its
one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import (
    FLOAT_DTYPES,
    interpreted,
    require,
    require_same_device,
)
from engine.kernels.matmul_tiling import MIN_DOT_DIM, MatmulTiling, check_tiling

_MAX_BLOCK_M = 64
_DECODE_ROWS = 16  # up to this many rows: a decode step's tiles
NUM_BITS = (4, 8)


def default_tiling(num_rows: int, dtype: torch.dtype) -> MatmulTiling:
    """A decode step (<= 16 rows): 16-row tiles, narrow (32 outputs) so that many programs
    stream the weight, and long K steps (128 inputs); a prefill: tiles as tall as the rows (up
    to 64), 64 x 64 steps. float32 takes K steps of 32 (its tiles take twice the shared memory)."""
    if num_rows <= _DECODE_ROWS:
        block_k = 32 if dtype == torch.float32 else 128
        return MatmulTiling(block_m=MIN_DOT_DIM, block_n=32, block_k=block_k, num_stages=4)
    block_m = min(_MAX_BLOCK_M, triton.next_power_of_2(num_rows))
    return MatmulTiling(block_m=block_m, block_k=32 if dtype == torch.float32 else 64)


def usable(x: torch.Tensor) -> bool:
    """The kernel takes ``x``: a float tensor on a CUDA device."""
    return x.is_cuda and x.dtype in FLOAT_DTYPES


@triton.jit
def _packed_int_matmul_kernel(
    x_ptr,  # [num_rows, in_features]
    packed_ptr,  # [out_features, in_features / PACK] int32
    scale_ptr,  # [out_features, num_groups]
    zero_ptr,  # [out_features / PACK, num_groups] int32 (read only when HAS_ZERO)
    bias_ptr,  # [out_features] (read only when HAS_BIAS)
    out_ptr,  # [num_rows, out_features], contiguous
    num_rows,
    out_features,
    in_features,
    group_size,
    x_stride_row,
    x_stride_col,
    packed_stride_row,
    packed_stride_col,
    scale_stride_row,
    scale_stride_col,
    zero_stride_row,
    zero_stride_col,
    NUM_BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TILE_IN_ONE_GROUP: tl.constexpr,  # every K tile lies inside one group
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    PACK: tl.constexpr = 32 // NUM_BITS
    MASK: tl.constexpr = (1 << NUM_BITS) - 1
    OFFSET: tl.constexpr = 1 << (NUM_BITS - 1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of the outputs
    row_mask = rows < num_rows
    col_mask = cols < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride_row  # [BLOCK_M, 1]
    packed_cols = packed_ptr + cols.to(tl.int64)[None, :] * packed_stride_row  # [1, BLOCK_N]
    scale_cols = scale_ptr + cols[None, :] * scale_stride_row  # [1, BLOCK_N]
    zero_cols = zero_ptr + (cols // PACK)[None, :] * zero_stride_row  # [1, BLOCK_N]
    zero_shifts = ((cols % PACK) * NUM_BITS)[None, :]  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < in_features
        x_mask = row_mask[:, None] & k_mask[None, :]
        a = tl.load(x_rows + ks[None, :] * x_stride_col, mask=x_mask, other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]  # [BLOCK_K, BLOCK_N]
        # the step's words, each read once: [BLOCK_K / PACK, BLOCK_N]
        word_index = k_start // PACK + tl.arange(0, BLOCK_K // PACK)
        word_mask = (word_index < in_features // PACK)[:, None] & col_mask[None, :]
        words = tl.load(
            packed_cols + word_index[:, None] * packed_stride_col, mask=word_mask, other=0
        )
        # each word repeated for its PACK inputs, in order: [BLOCK_K, BLOCK_N]
        words = tl.broadcast_to(words[:, None, :], (BLOCK_K // PACK, PACK, BLOCK_N))
        words = tl.reshape(words, (BLOCK_K, BLOCK_N))
        q = (words >> ((ks % PACK) * NUM_BITS)[:, None]) & MASK  # unsigned, [BLOCK_K, BLOCK_N]
        if TILE_IN_ONE_GROUP:  # one scale (and zero point) per output: [1, BLOCK_N]
            groups = k_start // group_size
            group_mask = col_mask[None, :]
        else:  # each input's own group: [BLOCK_K, 1]
            groups = (ks // group_size)[:, None]
            group_mask = w_mask
        scale = tl.load(scale_cols + groups * scale_stride_col, mask=group_mask, other=0.0)
        if HAS_ZERO:
            zero_words = tl.load(zero_cols + groups * zero_stride_col, mask=group_mask, other=0)
            integers = q - ((zero_words >> zero_shifts) & MASK)  # the offsets cancel
        else:
            integers = q - OFFSET
        # (q - zero) * scale rounds to the scale's dtype, then to x's, as the torch path
        w = integers.to(tl.float32) * scale.to(tl.float32)
        w = w.to(scale_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_offsets = rows.to(tl.int64)[:, None] * out_features + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def packed_int_matmul(
    x: torch.Tensor,  # [num_rows, in_features] float
    weight_packed: torch.Tensor,  # [out_features, in_features / pack] int32
    weight_scale: torch.Tensor,  # [out_features, num_groups] float
    weight_zero_point: torch.Tensor | None,  # [out_features / pack, num_groups] int32
    num_bits: int,  # 4 or 8
    bias: torch.Tensor | None = None,  # [out_features] of x's dtype
    tiling: MatmulTiling | None = None,
) -> torch.Tensor:  # [num_rows, out_features] of x's dtype
    """x @ W.T (+ bias), W the dequantized packed weight (module docstring), as
    ``PackedIntLinear``'s torch path computes it. Raises ValueError naming the argument on a
    wrong shape, dtype or device."""
    _check(x, weight_packed, weight_scale, weight_zero_point, num_bits, bias)
    num_rows, in_features = x.shape
    out_features, num_groups = weight_scale.shape
    if tiling is None:
        tiling = default_tiling(num_rows, x.dtype)
    check_tiling(tiling)
    out = x.new_empty(num_rows, out_features)
    if num_rows == 0 or out_features == 0:
        return out
    group_size = in_features // num_groups
    zero = weight_zero_point if weight_zero_point is not None else weight_packed
    grid = (triton.cdiv(num_rows, tiling.block_m), triton.cdiv(out_features, tiling.block_n))
    _packed_int_matmul_kernel[grid](
        x,
        weight_packed,
        weight_scale,
        zero,  # (not read without zero points)
        bias if bias is not None else out,  # (not read without a bias)
        out,
        num_rows,
        out_features,
        in_features,
        group_size,
        x.stride(0),
        x.stride(1),
        weight_packed.stride(0),
        weight_packed.stride(1),
        weight_scale.stride(0),
        weight_scale.stride(1),
        zero.stride(0),
        zero.stride(1),
        NUM_BITS=num_bits,
        HAS_ZERO=weight_zero_point is not None,
        HAS_BIAS=bias is not None,
        TILE_IN_ONE_GROUP=num_groups == 1 or group_size % tiling.block_k == 0,
        # Triton 3.9's interpreter multiplies bf16 dot operands as raw uint16 bits
        DOT_FP32=interpreted() or x.dtype == torch.float32,
        **tiling.launch_options(),
    )
    return out


def _check(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    num_bits: int,
    bias: torch.Tensor | None,
) -> None:
    require(x.dim() == 2, f"x must be [num_rows, in_features], got {list(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    require(num_bits in NUM_BITS, f"num_bits must be 4 or 8, got {num_bits}")
    pack = 32 // num_bits
    in_features = x.shape[1]
    require(
        in_features % pack == 0,
        f"x's in_features {in_features} must be a multiple of {pack} ({num_bits}-bit packing)",
    )
    require(
        weight_packed.dim() == 2 and weight_packed.shape[1] == in_features // pack,
        f"weight_packed must be [out_features, in_features / {pack} = {in_features // pack}], "
        f"got {list(weight_packed.shape)}",
    )
    require(
        weight_packed.dtype == torch.int32,
        f"weight_packed must be int32, got {weight_packed.dtype}",
    )
    out_features = weight_packed.shape[0]
    require(
        weight_scale.dim() == 2
        and weight_scale.shape[0] == out_features
        and weight_scale.shape[1] >= 1
        and in_features % weight_scale.shape[1] == 0,
        f"weight_scale must be [out_features = {out_features}, num_groups], num_groups "
        f"dividing in_features {in_features}, got {list(weight_scale.shape)}",
    )
    require(
        weight_scale.dtype in FLOAT_DTYPES,
        f"weight_scale dtype must be one of {FLOAT_DTYPES}, got {weight_scale.dtype}",
    )
    tensors = {"weight_packed": weight_packed, "weight_scale": weight_scale}
    if weight_zero_point is not None:
        num_groups = weight_scale.shape[1]
        require(
            out_features % pack == 0
            and tuple(weight_zero_point.shape) == (out_features // pack, num_groups),
            f"weight_zero_point must be [out_features / {pack}, num_groups] = "
            f"[{out_features / pack:g}, {num_groups}], got {list(weight_zero_point.shape)}",
        )
        require(
            weight_zero_point.dtype == torch.int32,
            f"weight_zero_point must be int32, got {weight_zero_point.dtype}",
        )
        tensors["weight_zero_point"] = weight_zero_point
    if bias is not None:
        require(
            tuple(bias.shape) == (out_features,) and bias.is_contiguous(),
            f"bias must be a contiguous [out_features = {out_features}], got {list(bias.shape)}",
        )
        require(bias.dtype == x.dtype, f"bias dtype {bias.dtype} != x's {x.dtype}")
        tensors["bias"] = bias
    require_same_device(x, "x", **tensors)
