"""Triton kernels: the routed experts of a mixture-of-experts layer on a GPU, as two grouped
matmuls over the (token, expert) pairs sorted by expert.

The pairs are sorted by expert (a stable sort: each expert's tokens in order), so expert e's
rows are ``row_starts[e] .. row_starts[e + 1]`` of the sorted order. Each expert's rows are cut
into tiles of ``BLOCK_M`` rows (its last tile masked), and the tiles are numbered expert after
expert, ``tile_starts[e] .. tile_starts[e + 1]``; both offsets come from a sort and a
``searchsorted`` on the device, so nothing waits for the GPU. A program takes one row tile and
``BLOCK_N`` output columns: it finds its tile's expert by counting the experts whose tiles end
at or before it (the grid has a tile for every case, ``num_pairs // BLOCK_M + min(num_pairs,
num_experts)``; the spare ones return at once), and multiplies its rows by that expert's
weights, ``BLOCK_K`` inputs at a time, accumulating in float32. The grid's first axis is the row
tiles, so an expert's row tiles (a prefill's) run side by side on the same weight columns, which
the L2 cache can then serve to all of them from one read.

1. ``_gate_up_kernel``: each row is its token's row of ``x``; a program holds the gate and the
   up accumulator of its columns, and its epilogue writes the activation, SiLU(gate) * up or
   gpt-oss's clamped SwiGLU (biases added first), into the ``[num_pairs, intermediate]`` rows
   in expert order.
2. ``_down_kernel``: those rows times the down projection (plus its bias), times the pair's
   routing weight, written to the pair's own row ``token * top_k + slot``.

A token's ``top_k`` rows are then summed in torch (``sum`` over the slots, which accumulates
16-bit dtypes in float32). No step uses atomics and each output element is one program's sum
over the inputs in a fixed order, so a result's bits do not change from run to run.

Every value the torch experts (``engine/models/moe.py``) hold as a tensor of the input's dtype
is rounded to that dtype here too (the projections' outputs, the biases' sums, each activation
step, the weighted rows), so in 16-bit dtypes the kernels differ from the torch path only by
the matmuls' summation order and the final sum's (torch's path rounds after each expert's add).

Before the launches nothing waits for the GPU; the tokens per expert come back as a device
tensor, and reading them (the model's metrics) is the layer's one wait.

Under expert parallelism the weights are a rank's run of experts (``held``) and the ids the
router's, of all experts: the pairs of other ranks' experts take the id past the held ones,
so the sort puts them last and no tile covers them, and their rows of the output stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    interpreted,
    require,
    require_same_device,
)
from engine.kernels.matmul_tiling import MIN_DOT_DIM, MatmulTiling, check_tiling

_MAX_BLOCK_M = 64  # rows per tile at most (prefill); decode tiles take 16


def default_tiling(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MatmulTiling:
    """Tiles as tall as an expert's mean number of rows (16 .. 64), K steps of 64 inputs (32 in
    float32, whose tiles take twice the shared memory)."""
    mean_rows = -(-num_pairs // max(1, num_experts))
    block_m = min(_MAX_BLOCK_M, max(MIN_DOT_DIM, triton.next_power_of_2(mean_rows)))
    return MatmulTiling(block_m=block_m, block_k=32 if dtype == torch.float32 else 64)


def usable(x: torch.Tensor) -> bool:
    """The fused experts take ``x``: a float tensor on a CUDA device."""
    return x.is_cuda and x.dtype in FLOAT_DTYPES


@dataclass(frozen=True, slots=True)
class _Projection:
    """A stacked projection as the kernels address it: expert e's weight for input k and output
    column n is at ``weight[e] + k * stride_k + n * stride_n``."""

    weight: torch.Tensor  # [num_experts, ...]
    stride_k: int
    stride_n: int
    bias: torch.Tensor | None  # [num_experts, columns], contiguous in columns


@dataclass(frozen=True, slots=True)
class _ExpertRows:
    """The (token, slot) pairs sorted by expert, and where each expert's rows and tiles lie."""

    sorted_pairs: torch.Tensor  # [num_pairs] int64: token * top_k + slot of each row, by expert
    row_starts: torch.Tensor  # [num_experts + 1] int64: expert e's rows start here
    tile_starts: torch.Tensor  # [num_experts + 1] int64: expert e's row tiles start here
    counts: torch.Tensor  # [num_experts] int64: rows (tokens) per expert
    num_tiles: int  # the grid's tiles: at least as many as the experts' tiles take


@triton.jit
def _tile_rows(
    tile,
    row_starts_ptr,  # [num_experts + 1]
    tile_starts_ptr,  # [num_experts + 1]
    num_experts,
    BLOCK_M: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,  # power of two >= num_experts
):
    """The expert of row tile ``tile`` (num_experts for a spare tile past the last), the tile's
    rows in expert order, and which of them are the expert's."""
    experts = tl.arange(0, EXPERTS_PAD)
    tile_ends = tl.load(tile_starts_ptr + 1 + experts, mask=experts < num_experts, other=0)
    expert = tl.sum(((tile_ends <= tile) & (experts < num_experts)).to(tl.int32), axis=0)
    known = tl.minimum(expert, num_experts - 1)  # (a spare tile's rows are never used)
    first_tile = tl.load(tile_starts_ptr + known)
    row_start = tl.load(row_starts_ptr + known) + (tile - first_tile) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < tl.load(row_starts_ptr + known + 1)
    return expert, rows, row_mask


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, hidden], contiguous
    sorted_pairs_ptr,  # [num_pairs]: token * TOP_K + slot of each row, by expert
    row_starts_ptr,  # [num_experts + 1]
    tile_starts_ptr,  # [num_experts + 1]
    weight_ptr,  # [num_experts, ...]: column n, input k at + k * stride_k + n * stride_n
    bias_ptr,  # [num_experts, 2 * intermediate] (read only when CLAMPED_SWIGLU)
    out_ptr,  # [num_pairs, intermediate]: the activation of each row, in expert order
    hidden,
    intermediate,
    num_experts,
    weight_stride_expert,
    weight_stride_k,
    weight_stride_n,
    up_offset,  # column j's gate is weight column GATE_STEP * j, its up GATE_STEP * j + this
    alpha,  # the clamped SwiGLU's sigmoid(alpha * gate) (read only when CLAMPED_SWIGLU)
    limit,  # ... and the clamps' limit
    TOP_K: tl.constexpr,
    GATE_STEP: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,  # gpt-oss's activation, biases added; else SiLU(gate) * up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast dot operands (float32 inputs, or the interpreter)
):
    expert, rows, row_mask = _tile_rows(
        tl.program_id(0), row_starts_ptr, tile_starts_ptr, num_experts, BLOCK_M, EXPERTS_PAD
    )
    if expert >= num_experts:  # a spare tile of the grid
        return
    tokens = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0) // TOP_K  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of intermediate
    col_mask = cols < intermediate
    gate_cols = cols * GATE_STEP
    up_cols = gate_cols + up_offset
    expert_weights = weight_ptr + expert.to(tl.int64) * weight_stride_expert
    gate_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, hidden, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < hidden
        a_mask = row_mask[:, None] & k_mask[None, :]
        a_offsets = tokens.to(tl.int64)[:, None] * hidden + ks[None, :]
        a = tl.load(x_ptr + a_offsets, mask=a_mask, other=0.0)
        w_rows = expert_weights + ks[:, None].to(tl.int64) * weight_stride_k  # [BLOCK_K, 1]
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate_w = tl.load(w_rows + gate_cols[None, :] * weight_stride_n, mask=w_mask, other=0.0)
        up_w = tl.load(w_rows + up_cols[None, :] * weight_stride_n, mask=w_mask, other=0.0)
        if DOT_FP32:
            a, gate_w, up_w = a.to(tl.float32), gate_w.to(tl.float32), up_w.to(tl.float32)
        gate_acc = tl.dot(a, gate_w, gate_acc, input_precision="ieee")
        up_acc = tl.dot(a, up_w, up_acc, input_precision="ieee")

    dtype = out_ptr.dtype.element_ty
    # each value rounds where the torch experts round it: the projection's output, each step
    gate = gate_acc.to(dtype).to(tl.float32)
    up = up_acc.to(dtype).to(tl.float32)
    if CLAMPED_SWIGLU:
        biases = bias_ptr + expert.to(tl.int64) * (2 * intermediate)
        gate_bias = tl.load(biases + gate_cols, mask=col_mask, other=0.0).to(tl.float32)
        up_bias = tl.load(biases + up_cols, mask=col_mask, other=0.0).to(tl.float32)
        gate = tl.minimum((gate + gate_bias).to(dtype).to(tl.float32), limit)
        up = tl.minimum(tl.maximum((up + up_bias).to(dtype).to(tl.float32), -limit), limit)
        scaled = (gate * alpha).to(dtype).to(tl.float32)
        sigmoid = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
        glu = (gate * sigmoid).to(dtype).to(tl.float32)
        out = (up + 1.0).to(dtype).to(tl.float32) * glu
    else:
        out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_offsets = rows.to(tl.int64)[:, None] * intermediate + cols[None, :]
    tl.store(out_ptr + out_offsets, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [num_pairs, intermediate]: the gate_up kernel's rows, in expert order
    sorted_pairs_ptr,  # [num_pairs]
    row_starts_ptr,  # [num_experts + 1]
    tile_starts_ptr,  # [num_experts + 1]
    weight_ptr,  # [num_experts, ...]: column n, input k at + k * stride_k + n * stride_n
    bias_ptr,  # [num_experts, hidden] (read only when HAS_BIAS)
    routing_weights_ptr,  # [num_pairs]: each pair's weight, in pair order
    out_ptr,  # [num_pairs, hidden]: each pair's weighted output, in pair order
    intermediate,
    hidden,
    num_experts,
    weight_stride_expert,
    weight_stride_k,
    weight_stride_n,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    expert, rows, row_mask = _tile_rows(
        tl.program_id(0), row_starts_ptr, tile_starts_ptr, num_experts, BLOCK_M, EXPERTS_PAD
    )
    if expert >= num_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of hidden
    col_mask = cols < hidden
    expert_weights = weight_ptr + expert.to(tl.int64) * weight_stride_expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, intermediate, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < intermediate
        a_mask = row_mask[:, None] & k_mask[None, :]
        a_offsets = rows.to(tl.int64)[:, None] * intermediate + ks[None, :]
        a = tl.load(act_ptr + a_offsets, mask=a_mask, other=0.0)
        w_offsets = ks[:, None].to(tl.int64) * weight_stride_k + cols[None, :] * weight_stride_n
        w = tl.load(expert_weights + w_offsets, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")

    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * hidden + cols, mask=col_mask, other=0.0)
        out = (out + bias.to(tl.float32)).to(dtype).to(tl.float32)
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)  # [BLOCK_M]
    routing = tl.load(routing_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    out = out * routing[:, None]
    out_offsets = pairs.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out_ptr + out_offsets, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


def silu_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    weights: torch.Tensor,  # [num_tokens, top_k] float: each pair's routing weight
    expert_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64
    gate_up_proj: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, up rows
    down_proj: torch.Tensor,  # [num_experts, hidden, intermediate]
    tiling: MatmulTiling | None = None,
    held: range | None = None,  # the weights' experts among the ids' (None: ids index them)
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, hidden], tokens per expert (int64)
    """Sums over each token's experts weight * down(SiLU(gate) * up), as ``RoutedExperts``
    (over the ``held`` experts alone where given).

    Returns the output and each (held) expert's number of pairs, on x's device (reading the
    counts is the caller's one wait for the GPU). Raises ValueError naming the argument on a
    wrong shape, dtype or device.
    """
    _check_routing(x, weights, expert_ids)
    hidden = x.shape[1]
    require(
        gate_up_proj.dim() == 3 and gate_up_proj.shape[1] % 2 == 0,
        f"gate_up_proj must be [num_experts, 2 * intermediate, hidden = {hidden}], "
        f"got {list(gate_up_proj.shape)}",
    )
    num_experts, width, _ = gate_up_proj.shape
    intermediate = width // 2
    _check_weight("gate_up_proj", gate_up_proj, (num_experts, width, hidden), x)
    _check_weight("down_proj", down_proj, (num_experts, hidden, intermediate), x)
    _check_expert_ids(expert_ids, num_experts, held)
    gate_up = _Projection(gate_up_proj, gate_up_proj.stride(2), gate_up_proj.stride(1), None)
    down = _Projection(down_proj, down_proj.stride(2), down_proj.stride(1), None)
    ids = _held_ids(expert_ids, held)
    return _fused_experts(x, weights, ids, gate_up, down, intermediate, tiling, held=held)


def clamped_swiglu_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    weights: torch.Tensor,  # [num_tokens, top_k] float: each pair's routing weight
    expert_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64
    gate_up_proj: torch.Tensor,  # [num_experts, hidden, 2 * intermediate]: gate, up interleaved
    gate_up_bias: torch.Tensor,  # [num_experts, 2 * intermediate]
    down_proj: torch.Tensor,  # [num_experts, intermediate, hidden]
    down_bias: torch.Tensor,  # [num_experts, hidden]
    alpha: float,
    limit: float,
    tiling: MatmulTiling | None = None,
    held: range | None = None,  # the weights' experts among the ids' (None: ids index them)
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, hidden], tokens per expert (int64)
    """Sums over each token's experts weight * (act @ down + down_bias), as gpt-oss's
    ``ClampedSwigluExperts``: gate, up = x @ gate_up + gate_up_bias (columns 2j, 2j + 1),
    gate clamped from above and up both ways at ``limit``, act = (up + 1) * gate *
    sigmoid(alpha * gate); over the ``held`` experts alone where given.

    Returns the output and each (held) expert's number of pairs, on x's device. Raises
    ValueError naming the argument on a wrong shape, dtype or device.
    """
    _check_routing(x, weights, expert_ids)
    hidden = x.shape[1]
    require(
        gate_up_proj.dim() == 3 and gate_up_proj.shape[2] % 2 == 0,
        f"gate_up_proj must be [num_experts, hidden = {hidden}, 2 * intermediate], "
        f"got {list(gate_up_proj.shape)}",
    )
    num_experts, _, width = gate_up_proj.shape
    intermediate = width // 2
    _check_weight("gate_up_proj", gate_up_proj, (num_experts, hidden, width), x)
    _check_weight("gate_up_bias", gate_up_bias, (num_experts, width), x)
    _check_weight("down_proj", down_proj, (num_experts, intermediate, hidden), x)
    _check_weight("down_bias", down_bias, (num_experts, hidden), x)
    require(gate_up_bias.is_contiguous(), "gate_up_bias must be contiguous")
    require(down_bias.is_contiguous(), "down_bias must be contiguous")
    require(limit > 0, f"limit must be > 0, got {limit}")
    _check_expert_ids(expert_ids, num_experts, held)
    gate_up = _Projection(
        gate_up_proj, gate_up_proj.stride(1), gate_up_proj.stride(2), gate_up_bias
    )
    down = _Projection(down_proj, down_proj.stride(1), down_proj.stride(2), down_bias)
    ids = _held_ids(expert_ids, held)
    return _fused_experts(
        x, weights, ids, gate_up, down, intermediate, tiling, (alpha, limit), held
    )


def _held_ids(expert_ids: torch.Tensor, held: range | None) -> torch.Tensor:
    """The ids as indices of the held experts' weights; another rank's expert takes the index
    past the last held one (None: the ids are those indices already)."""
    if held is None:
        return expert_ids
    local = expert_ids - held.start
    return local.masked_fill((local < 0) | (local >= len(held)), len(held))


def _fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: _Projection,
    down: _Projection,
    intermediate: int,
    tiling: MatmulTiling | None,
    clamped_swiglu: tuple[float, float] | None = None,  # (alpha, limit) of gpt-oss's activation
    held: range | None = None,  # expert parallelism: ids past the weights' are other ranks'
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorts the pairs, runs both launches and sums each token's rows (arguments checked)."""
    num_experts = gate_up.weight.shape[0]
    num_tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    if tiling is None:
        tiling = default_tiling(num_pairs, num_experts, x.dtype)
    check_tiling(tiling)
    rows = _sort_by_expert(expert_ids, num_experts, tiling.block_m)
    if num_pairs == 0 or intermediate == 0:
        return torch.zeros_like(x), rows.counts
    x = x.contiguous()
    common = {
        "EXPERTS_PAD": triton.next_power_of_2(num_experts),
        # Triton 3.9's interpreter multiplies bf16 dot operands as raw uint16 bits
        "DOT_FP32": interpreted() or x.dtype == torch.float32,
        "BLOCK_M": tiling.block_m,
        "BLOCK_N": tiling.block_n,
        "BLOCK_K": tiling.block_k,
        "num_warps": tiling.num_warps,
        "num_stages": tiling.num_stages,
    }
    act = x.new_empty(num_pairs, intermediate)  # [num_pairs, intermediate] in expert order
    alpha, limit = clamped_swiglu or (0.0, 0.0)
    gate_step, up_offset = (2, 1) if clamped_swiglu else (1, intermediate)
    _gate_up_kernel[(rows.num_tiles, triton.cdiv(intermediate, tiling.block_n))](
        x,
        rows.sorted_pairs,
        rows.row_starts,
        rows.tile_starts,
        gate_up.weight,
        x if gate_up.bias is None else gate_up.bias,  # (not read without a bias)
        act,
        hidden,
        intermediate,
        num_experts,
        gate_up.weight.stride(0),
        gate_up.stride_k,
        gate_up.stride_n,
        up_offset,
        alpha,
        limit,
        TOP_K=top_k,
        GATE_STEP=gate_step,
        CLAMPED_SWIGLU=clamped_swiglu is not None,
        **common,
    )
    # [num_pairs, hidden] in pair order; another rank's pairs are never written
    weighted = x.new_empty(num_pairs, hidden) if held is None else x.new_zeros(num_pairs, hidden)
    _down_kernel[(rows.num_tiles, triton.cdiv(hidden, tiling.block_n))](
        act,
        rows.sorted_pairs,
        rows.row_starts,
        rows.tile_starts,
        down.weight,
        x if down.bias is None else down.bias,  # (not read without a bias)
        weights.reshape(-1),
        weighted,
        intermediate,
        hidden,
        num_experts,
        down.weight.stride(0),
        down.stride_k,
        down.stride_n,
        HAS_BIAS=down.bias is not None,
        **common,
    )
    if top_k == 1:
        return weighted, rows.counts
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1), rows.counts


def _sort_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> _ExpertRows:
    """The pairs sorted by expert (stably), and each expert's rows and tiles, on the device."""
    sorted_ids, sorted_pairs = torch.sort(expert_ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts + 1, device=expert_ids.device, dtype=sorted_ids.dtype)
    row_starts = torch.searchsorted(sorted_ids, experts)  # [num_experts + 1]
    counts = row_starts.diff()  # [num_experts]
    tile_starts = F.pad(((counts + block_m - 1) // block_m).cumsum(0), (1, 0))
    num_pairs = sorted_ids.shape[0]
    # each expert's tiles: its full ones, and one partial one when it has any rows
    num_tiles = num_pairs // block_m + min(num_pairs, num_experts)
    return _ExpertRows(sorted_pairs, row_starts, tile_starts, counts, num_tiles)


def _check_routing(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> None:
    require(x.dim() == 2, f"x must be [num_tokens, hidden], got {list(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    num_tokens = x.shape[0]
    require(
        expert_ids.dim() == 2 and expert_ids.shape[0] == num_tokens and expert_ids.shape[1] >= 1,
        f"expert_ids must be [num_tokens = {num_tokens}, top_k], got {list(expert_ids.shape)}",
    )
    require(
        expert_ids.dtype in INDEX_DTYPES,
        f"expert_ids must be int32 or int64, got {expert_ids.dtype}",
    )
    require(
        weights.shape == expert_ids.shape,
        f"weights must be [num_tokens, top_k] = {list(expert_ids.shape)}, "
        f"got {list(weights.shape)}",
    )
    require(
        weights.dtype in FLOAT_DTYPES,
        f"weights dtype must be one of {FLOAT_DTYPES}, got {weights.dtype}",
    )
    require_same_device(x, "x", weights=weights, expert_ids=expert_ids)


def _check_expert_ids(expert_ids: torch.Tensor, num_experts: int, held: range | None) -> None:
    """``held`` names as many experts as the weights hold; on CPU, where reading them costs
    no wait for a GPU, every id names an expert (without ``held``, one of the weights')."""
    if held is not None:
        require(
            len(held) == num_experts and held.step == 1 and held.start >= 0,
            f"held must be a run of the weights' {num_experts} experts, got {held}",
        )
    if expert_ids.device.type != "cpu" or expert_ids.numel() == 0:
        return
    lowest, highest = int(expert_ids.min()), int(expert_ids.max())
    require(
        lowest >= 0 and (held is not None or highest < num_experts),
        f"expert_ids must be in [0, {num_experts}), got {lowest} .. {highest}",
    )


def _check_weight(name: str, tensor: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor) -> None:
    require(tuple(tensor.shape) == shape, f"{name} must be {list(shape)}, got {list(tensor.shape)}")
    require(tensor.dtype == x.dtype, f"{name} dtype {tensor.dtype} != x's {x.dtype}")
    require_same_device(x, "x", **{name: tensor})
