"""Triton kernels for the model's elementwise steps on a GPU: RMSNorm, residual add + RMSNorm,
rotary embedding of q and k in place, SiLU(gate) * up.

Each replaces several torch launches (and as many passes over the activations) with one; in a
decode step of a big model at small batch those launches, not their bytes, are what costs.
The functions mirror ``engine/kernels/cpu/elementwise.py``, so model code picks either by
tensor (``engine/models/fused_ops.py``).

Every result rounds where the torch code it replaces rounds (each torch op on a 16-bit tensor
computes in float32 and rounds to the tensor's dtype), and the kernels are compiled without
FMA contraction, so for one input they give what torch gives up to the order of the RMS sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import (
    FLOAT_DTYPES,
    require,
    require_contiguous_heads,
    require_same_device,
)

_MAX_ROW = 65536  # elements of one row a program holds in registers
_SILU_BLOCK = 1024  # output elements per SiLU * up program


def usable(x: torch.Tensor) -> bool:
    """The Triton kernels take ``x``: a float tensor on a CUDA device."""
    return x.is_cuda and x.dtype in FLOAT_DTYPES


@triton.jit
def _rms_norm_kernel(
    residual_ptr,  # [num_rows, dim]: added to x first when HAS_RESIDUAL
    x_ptr,  # [num_rows, dim]
    weight_ptr,  # [dim]
    total_ptr,  # [num_rows, dim]: residual + x, written when HAS_RESIDUAL
    out_ptr,  # [num_rows, dim]
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= dim
):
    row = tl.program_id(0).to(tl.int64) * dim
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row + cols, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # the add rounds, as torch's
        tl.store(total_ptr + row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    # transformers' order: normalise in float32, cast back, then scale by the weight
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; [..., dim] -> [..., dim] contiguous."""
    x = x.contiguous()
    _check_norm(x, weight)
    out = torch.empty_like(x)
    _launch_norm(None, x, weight, None, out, eps)
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x)) in one pass; [num_tokens, hidden] each."""
    residual, x = residual.contiguous(), x.contiguous()
    _check_norm(x, weight)
    require(
        residual.shape == x.shape and residual.dtype == x.dtype,
        f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
        f"got {tuple(residual.shape)}, {residual.dtype}",
    )
    require_same_device(x, "x", residual=residual)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _launch_norm(residual, x, weight, total, out, eps)
    return total, out


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    require(x.dim() >= 1 and x.shape[-1] >= 1, f"x must be [..., dim], got {tuple(x.shape)}")
    dim = x.shape[-1]
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    require(dim <= _MAX_ROW, f"x's last dim must be <= {_MAX_ROW}, got {dim}")
    require(
        weight.shape == (dim,) and weight.dtype == x.dtype,
        f"weight must be [{dim}] of x's dtype {x.dtype}, got {tuple(weight.shape)} {weight.dtype}",
    )
    require(weight.is_contiguous(), "weight must be contiguous")
    require_same_device(x, "x", weight=weight)


def _launch_norm(
    residual: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    total: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
) -> None:
    dim = x.shape[-1]
    num_rows = x.numel() // dim
    if num_rows == 0:
        return
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(num_rows,)](
        residual if residual is not None else x,
        x,
        weight,
        total if total is not None else out,
        out,
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        enable_fp_fusion=False,
    )


@triton.jit
def _rotary_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim], heads contiguous; rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], the same
    cos_ptr,  # [num_tokens, 1, head_dim // 2], last dim contiguous
    sin_ptr,  # [num_tokens, 1, head_dim // 2]
    query_stride_token,
    key_stride_token,
    cos_stride_token,
    sin_stride_token,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # power of two >= max(NUM_HEADS, NUM_KV_HEADS)
    HALF_PAD: tl.constexpr,  # power of two >= HALF_DIM
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF_DIM
    cos = tl.load(cos_ptr + token * cos_stride_token + dims, mask=dim_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * sin_stride_token + dims, mask=dim_mask, other=0.0)[None, :]
    heads = tl.arange(0, HEADS_PAD)
    _rotate_heads(query_ptr + token * query_stride_token, heads, dims, dim_mask, cos, sin,
                  NUM_HEADS, HALF_DIM)  # fmt: skip
    _rotate_heads(key_ptr + token * key_stride_token, heads, dims, dim_mask, cos, sin,
                  NUM_KV_HEADS, HALF_DIM)  # fmt: skip


@triton.jit
def _rotate_heads(
    base_ptr,  # one token's heads, [num_heads, 2 * HALF_DIM] contiguous
    heads,  # [HEADS_PAD]
    dims,  # [HALF_PAD]
    dim_mask,  # [HALF_PAD]
    cos,  # [1, HALF_PAD] in the tensor's dtype
    sin,  # [1, HALF_PAD]
    NUM_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
):
    """x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product and sum rounded like torch's."""
    mask = (heads[:, None] < NUM_HEADS) & dim_mask[None, :]
    first = base_ptr + heads[:, None] * (2 * HALF_DIM) + dims[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF_DIM, mask=mask, other=0.0)
    dtype = x1.dtype
    x1_cos = (x1.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
    x2_sin = (x2.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)
    x2_cos = (x2.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
    x1_sin = (x1.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + HALF_DIM, (x2_cos + x1_sin).to(dtype), mask=mask)


def rotary_(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads contiguous; rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], the same
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> None:
    """Rotate-half rope of q and k in place (views into the fused qkv projection's output)."""
    require(
        query.dim() == 3,
        f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}",
    )
    num_tokens, num_heads, head_dim = query.shape
    require(head_dim % 2 == 0, f"query's head_dim must be even, got {head_dim}")
    require(
        key.dim() == 3 and key.shape[0] == num_tokens and key.shape[2] == head_dim,
        f"key must be [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(key.shape)}",
    )
    require_contiguous_heads("query", query)
    require_contiguous_heads("key", key)
    for name, table in (("cos", cos), ("sin", sin)):
        require(
            table.shape == (num_tokens, 1, head_dim // 2),
            f"{name} must be [{num_tokens}, 1, {head_dim // 2}], got {tuple(table.shape)}",
        )
        require(table.stride(2) == 1, f"{name}'s last dim must be contiguous")
        require(table.dtype == query.dtype, f"{name} dtype {table.dtype} != query's {query.dtype}")
    require(key.dtype == query.dtype, f"key dtype {key.dtype} != query's {query.dtype}")
    require(query.dtype in FLOAT_DTYPES, f"query dtype must be one of {FLOAT_DTYPES}")
    require_same_device(query, "query", key=key, cos=cos, sin=sin)
    if num_tokens == 0:
        return
    half_dim = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        cos,
        sin,
        query.stride(0),
        key.stride(0),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=key.shape[1],
        HALF_DIM=half_dim,
        HEADS_PAD=triton.next_power_of_2(max(num_heads, key.shape[1])),
        HALF_PAD=triton.next_power_of_2(half_dim),
        enable_fp_fusion=False,
    )


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_rows, 2 * dim], contiguous: gate then up
    out_ptr,  # [num_rows, dim]
    dim,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    gate = tl.load(gate_up_ptr + row * 2 * dim + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * dim + dim + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)  # F.silu rounds its output
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [n, 2d] -> [n, d]."""
    require(
        gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0,
        f"gate_up's last dim must be even ([..., 2 * dim]), got {tuple(gate_up.shape)}",
    )
    require(gate_up.dtype in FLOAT_DTYPES, f"gate_up dtype must be one of {FLOAT_DTYPES}")
    require_same_device(gate_up, "gate_up")
    gate_up = gate_up.contiguous()
    dim = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], dim)
    num_rows = gate_up.numel() // max(1, 2 * dim)
    if num_rows == 0 or dim == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(dim))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(dim, block))](
        gate_up, out, dim, BLOCK=block, enable_fp_fusion=False
    )
    return out
