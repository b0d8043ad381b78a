"""Triton kernels: decode attention (one new token per query row) over a paged KV cache.

For query row ``r`` and query head ``h`` (KV head ``h // group``, ``group = num_heads //
num_kv_heads``): ``softmax(scale * q[r, h] @ K_r.T) @ V_r`` over the first ``seq_lens[r]``
tokens of the blocks in ``block_tables[r]``. A row is usually a sequence's newest token; with
speculative decoding a sequence also has a row per draft token after it, each seeing one token
more than the row before. Given ``row_starts``, the rows of one sequence are folded into one
program, so its K/V are loaded once for all of them, not once per row. With a sliding window
``W``, a row of context ``n`` sees only its last ``W`` tokens, ``max(0, n - W) .. n - 1``.
With a logit soft-cap ``c`` each logit ``scale * q . k`` becomes ``c * tanh(logit / c)`` before
the mask; with attention sinks, head ``h``'s logit ``sinks[h]`` joins its softmax's denominator
as a position with no value. A quantized cache (float8 e4m3 or int8 elements, as
engine/kv_cache/kv_quantization.py stores them) is read as what its elements stand for,
``element * scale`` with the KV head's K and V scales: the elements, exact in the query's dtype,
go into the dots, the K scale into the logits' scale and the V scale into the output.

Flash-decoding, two kernels:

1. ``_decode_partition_kernel``, grid ``(num_groups, num_kv_heads, num_splits)``, a group
   being a sequence's rows (one row without ``row_starts``). The context is cut into
   ``num_splits`` partitions of ``tokens_per_split`` tokens; a program takes one (group, KV
   head, partition) and all ``group`` query heads sharing that KV head of each of its rows, as
   the rows of a ``[TILE_ROWS, head_dim]`` tile (padded to >= 16 rows for ``tl.dot``), so each
   K/V token is loaded once per group. It walks its partition in tiles of ``TILE`` tokens,
   each token's slot looked up through the block table (so a tile may span several blocks and
   any block size works), with an online softmax in float32 (logits in log2 units, ``exp2``),
   each tile row masked to its own context. A row's sink is counted by one partition only, the
   one holding the first position the row sees (0, or its window's start: the first the merge
   reads): its running max starts at the sink's logit and its sum at 1, so the partition's
   output, max and sum carry the sink as one more position, and the merge needs no change. It
   writes the partition's normalised output, max logit and sum of exp per row. A partition
   past a row's end writes max -inf, sum 0. With a window, the walk starts at the tile of the
   group's first row's window start, and neither the block-table entries nor the blocks before
   that start are read (they may be freed); a partition wholly before it is written empty.
2. ``merge_partitions_kernel``, grid ``(num_rows, num_heads)``: the log-sum-exp merge of the
   row's non-empty partitions into the output, in the query's dtype, one partition after
   another, from the one holding the row's window start: a row's bits depend on the partition
   size, never on how many partitions the grid has (``default_tokens_per_split`` keeps the
   size fixed per batch-size bucket).

With one partition the first kernel writes the output itself and the merge is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2_E,
    interpreted,
    is_quantized_cache,
    require,
    require_kv_cache_layer,
    require_kv_scales,
    require_power_of_two,
    require_same_device,
    require_sinks,
    require_softcap,
)

_MIN_DOT_DIM = 16  # tl.dot wants every dimension >= 16
_MAX_TILE = 64  # tokens per inner-loop tile
_MIN_TOKENS_PER_SPLIT = 256  # the automatic choice gives each partition at least this much work
_TARGET_PROGRAMS = 512  # ... and stops splitting once the grid has this many programs
_MAX_SPLITS = 64
_LOG2_E: tl.constexpr = tl.constexpr(LOG2_E)


@dataclass(frozen=True, slots=True)
class DecodeTiling:
    """How the partition kernel cuts its work; the defaults are what the engine runs."""

    max_tile: int = _MAX_TILE  # tokens per inner-loop tile at most (a power of two >= 16)
    num_warps: int = 4  # per program


@triton.jit
def _decode_partition_kernel(
    query_ptr,  # [num_rows, num_heads, head_dim], last dim contiguous
    cache_ptr,  # [2, num_blocks * block_size, num_kv_heads, head_dim], contiguous
    block_tables_ptr,  # [num_rows, max_blocks], last dim contiguous
    seq_lens_ptr,  # [num_rows]: each row's context, itself included
    row_starts_ptr,  # [num_groups + 1]: the rows of each sequence (read only when FOLDED)
    out_ptr,  # [num_rows, num_heads, head_dim]: written only when NUM_SPLITS == 1
    part_out_ptr,  # [num_rows, num_heads, NUM_SPLITS, head_dim] f32, normalised per partition
    part_max_ptr,  # [num_rows, num_heads, NUM_SPLITS] f32: max logit * log2(e)
    part_sum_ptr,  # [num_rows, num_heads, NUM_SPLITS] f32: sum of exp2(logit - max)
    query_stride_row,
    query_stride_head,
    block_tables_stride_row,
    v_cache_offset,  # num_blocks * block_size * num_kv_heads * head_dim: where V starts
    scale_log2,  # softmax scale * log2(e)
    tokens_per_split,  # a multiple of TILE
    window,  # a row of context n sees positions n - window .. n - 1 (read only when WINDOWED)
    softcap_log2,  # the logit soft-cap c * log2(e) (read only when SOFTCAP)
    sinks_ptr,  # [num_heads] f32: each head's sink logit (read only when SINKS)
    kv_scales_ptr,  # [2, NUM_KV_HEADS] f32: each head's K, then V scale (read if KV_QUANTIZED)
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    # power of two >= max(rows per group * GROUP_SIZE, 16); rows per group: 1 unless FOLDED
    TILE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # power of two >= 16
    NUM_SPLITS: tl.constexpr,
    FOLDED: tl.constexpr,  # a program takes a sequence's rows; else a row alone
    WINDOWED: tl.constexpr,  # a sliding window of ``window`` tokens
    SOFTCAP: tl.constexpr,  # logits become c * tanh(logit / c)
    SINKS: tl.constexpr,  # a sink logit per head joins the softmax's denominator
    DOT_FP32: tl.constexpr,  # upcast dot operands (fp32 inputs, or the interpreter)
    KV_QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8 elements
):
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if FOLDED:
        first_row = tl.load(row_starts_ptr + group).to(tl.int32)
        num_rows = tl.load(row_starts_ptr + group + 1).to(tl.int32) - first_row
    else:
        first_row = group
        num_rows = group * 0 + 1  # (a tensor, as the loaded one)
    last_row = first_row + tl.maximum(num_rows, 1) - 1
    # the sequence's context: its last row's (an empty group has none)
    seq_len = tl.where(num_rows > 0, tl.load(seq_lens_ptr + last_row).to(tl.int32), 0)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    if WINDOWED:
        # the group's first row sees from the earliest position: no tile before its window
        first_len = seq_len
        if FOLDED:
            first_len = tl.load(seq_lens_ptr + first_row, mask=num_rows > 0, other=0).to(tl.int32)
        window_start = tl.maximum(first_len - window, 0)
        walk_start = tl.maximum(split_start, window_start // TILE * TILE)
    else:
        walk_start = split_start

    # tile row r: query token r // GROUP_SIZE of the sequence, query head r % GROUP_SIZE of
    # this KV head's group
    tile_rows = tl.arange(0, TILE_ROWS)
    query_rows = first_row + tile_rows // GROUP_SIZE  # [TILE_ROWS]
    heads = kv_head * GROUP_SIZE + tile_rows % GROUP_SIZE  # [TILE_ROWS]
    row_mask = tile_rows < num_rows * GROUP_SIZE
    # each row attends to its own context: a draft's row sees one token more than the row
    # before it (a plain decode row sees the whole context)
    row_lens = tl.load(seq_lens_ptr + query_rows, mask=row_mask, other=0).to(tl.int32)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_offsets = query_rows.to(tl.int64)[:, None] * query_stride_row
    q_offsets += heads[:, None] * query_stride_head
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # [TILE_ROWS, HEAD_DIM_PAD]
    if KV_QUANTIZED:  # q . (k * k_scale) = (q . k) * k_scale; the V scale scales the output
        scale_log2 = scale_log2 * tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + NUM_KV_HEADS + kv_head)

    m_i = tl.full([TILE_ROWS], float("-inf"), tl.float32)  # running max logit (log2 units)
    l_i = tl.zeros([TILE_ROWS], tl.float32)  # running sum of exp2(logit - m_i)
    if SINKS:
        # the sink is counted once per row: by the partition holding the row's first position
        first_seen = tl.maximum(row_lens - window, 0) if WINDOWED else row_lens * 0
        counts_sink = row_mask & (first_seen // tokens_per_split == split)
        sinks = tl.load(sinks_ptr + heads, mask=counts_sink, other=0.0) * _LOG2_E
        m_i = tl.where(counts_sink, sinks, m_i)
        l_i = tl.where(counts_sink, 1.0, l_i)
    acc = tl.zeros([TILE_ROWS, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + last_row.to(tl.int64) * block_tables_stride_row
    for tile_start in range(walk_start, split_end, TILE):
        positions = tile_start + tl.arange(0, TILE)  # [TILE]
        token_mask = positions < split_end
        if WINDOWED:
            token_mask = token_mask & (positions >= window_start)
        block_ids = tl.load(block_table + positions // BLOCK_SIZE, mask=token_mask, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        # [TILE, HEAD_DIM_PAD]
        kv_offsets = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + v_cache_offset + kv_offsets, mask=kv_mask, other=0.0)
        if KV_QUANTIZED:  # the stored elements, exactly, in the dot's type
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        elif DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # [TILE_ROWS, TILE]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        if SOFTCAP:  # c * tanh(logit / c), in log2 units; tanh(x) = sign(x) (1 - e) / (1 + e)
            e = tl.exp2(tl.abs(scores) * (-2.0 * _LOG2_E) / softcap_log2)  # exp(-2 |logit / c|)
            tanh = (1.0 - e) / (1.0 + e)
            scores = tl.where(scores < 0, -tanh, tanh) * softcap_log2
        seen = token_mask[None, :] & (positions[None, :] < row_lens[:, None])
        if WINDOWED:
            seen = seen & (positions[None, :] >= row_lens[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row whose context ended before this tile, or whose window starts after it, may have
        # seen nothing yet: no NaN from it
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p rounded to the query's dtype, as a tensor-core dot takes it
        p = p.to(query_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out_rows = query_rows.to(tl.int64) * NUM_KV_HEADS * GROUP_SIZE + heads  # [TILE_ROWS]
    if KV_QUANTIZED:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # 0 only in rows masked off
        tl.store(
            out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # a partition past a row's own context (within its sequence's) or before its window is
        # written empty; the merge reads only the partitions of the row's window
        part_rows = out_rows * NUM_SPLITS + split
        part_out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], part_out, mask=q_mask
        )
        tl.store(part_max_ptr + part_rows, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_mask)


@triton.jit
def merge_partitions_kernel(
    out_ptr,  # [num_rows, num_heads, head_dim]
    part_out_ptr,  # [num_rows, num_heads, NUM_SPLITS, head_dim] f32
    part_max_ptr,  # [num_rows, num_heads, NUM_SPLITS] f32
    part_sum_ptr,  # [num_rows, num_heads, NUM_SPLITS] f32
    seq_lens_ptr,  # [num_rows]
    tokens_per_split,
    window,  # read only when WINDOWED
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    # One partition after another, in order, over the row's own partitions only (from the one
    # holding its window start): the result does not depend on NUM_SPLITS (a graph's grid
    # covers the static capacity, an eager step's only its longest context), and a single
    # partition is passed through unchanged.
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    num_parts = tl.minimum(tl.cdiv(seq_len, tokens_per_split), NUM_SPLITS)  # >= 1
    # the partition of the row's window start (< num_parts); those before it are empty
    first_part = tl.maximum(seq_len - window, 0) // tokens_per_split if WINDOWED else 0
    first = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    max_logit = tl.load(part_max_ptr + first + first_part)
    for part in range(first_part + 1, num_parts):
        max_logit = tl.maximum(max_logit, tl.load(part_max_ptr + first + part))
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for part in range(first_part, num_parts):
        weight = tl.exp2(tl.load(part_max_ptr + first + part) - max_logit) * tl.load(
            part_sum_ptr + first + part
        )
        part_out = tl.load(
            part_out_ptr + (first + part) * HEAD_DIM + dims, mask=dim_mask, other=0.0
        )
        acc += part_out * weight
        total += weight
    only = tl.load(part_out_ptr + (first + first_part) * HEAD_DIM + dims, mask=dim_mask, other=0.0)
    out = tl.where(num_parts - first_part == 1, only, acc / total)
    out_offsets = (row.to(tl.int64) * NUM_HEADS + head) * HEAD_DIM + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def default_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int) -> int:
    """Partitions per sequence: enough programs to fill a GPU, each with real work."""
    by_length = -(-max_seq_len // _MIN_TOKENS_PER_SPLIT)
    by_occupancy = -(-_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def default_tokens_per_split(
    max_context: int, num_seqs: int, num_kv_heads: int, max_tile: int = _MAX_TILE
) -> int:
    """Partition size for decode steps of ``num_seqs`` sequences whose contexts reach
    ``max_context`` at most (``default_num_splits`` partitions of the longest context).

    An engine fixes it per batch-size bucket: a sequence's partitions then do not depend on the
    step's longest context, so a CUDA graph (sized for the static capacity) and the eager
    forward of the same step compute the same bits.
    """
    num_splits = default_num_splits(max_context, num_seqs, num_kv_heads)
    return _whole_tiles(-(-max_context // num_splits), max_tile)


def _tile(tokens_per_split: int, max_tile: int) -> int:
    return min(max_tile, max(_MIN_DOT_DIM, triton.next_power_of_2(tokens_per_split)))


def _whole_tiles(tokens_per_split: int, max_tile: int) -> int:
    """``tokens_per_split`` rounded up to whole tiles (unchanged when it is already)."""
    tile = _tile(tokens_per_split, max_tile)
    return -(-tokens_per_split // tile) * tile


def paged_decode_attention(
    query: torch.Tensor,  # [num_rows, num_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_rows, max_blocks] int32 or int64, padded
    seq_lens: torch.Tensor,  # [num_rows] int32 or int64, each in [1, max_blocks * block_size]
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    tokens_per_split: int | None = None,
    tiling: DecodeTiling = DecodeTiling(),
    row_starts: torch.Tensor | None = None,  # [num_groups + 1] int32 or int64
    max_rows_per_seq: int = 1,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] float32: a quantized cache's
) -> torch.Tensor:  # [num_rows, num_heads, head_dim], query's dtype
    """Attention of each row's new token over its whole context in the paged cache.

    ``row_starts``: rows ``row_starts[g] .. row_starts[g + 1]`` are one sequence's successive
    tokens, at most ``max_rows_per_seq`` of them (a group may be empty), each row's context one
    longer than the row before, all in the blocks of the last row's table; from 0 to num_rows.
    One program then takes the whole group. None: every row is a sequence of its own.

    ``max_seq_len``: an upper bound on ``seq_lens``; None takes ``max_blocks * block_size``,
    which needs no device sync. Understating it drops tokens.
    The context is cut into partitions of ``tokens_per_split`` tokens (rounded up to whole
    tiles), as many as ``max_seq_len`` needs; a sequence's result depends only on its own
    partitions, so any bound gives the same bits. Or ``num_splits`` partitions of the bound
    (None, and no ``tokens_per_split``: ``default_num_splits``).
    ``sliding_window`` W: a row of context ``n`` (at position ``n - 1``) sees only positions
    ``max(0, n - W) .. n - 1``; the block-table entries before the window start of a group's
    first row are never read, and may hold anything. None: the whole context.
    ``logit_softcap`` c: each logit ``scale * q . k`` becomes ``c * tanh(logit / c)`` (in
    float32, before the mask). ``sinks``: head h's logit ``sinks[h]`` joins its softmax's
    denominator, ``p_j = exp(l_j) / (exp(sinks[h]) + sum_i exp(l_i))``.
    ``kv_scales``: given exactly when the cache stores float8_e4m3fn or int8 elements (the
    query then being float32, float16 or bfloat16); row 0 holds each KV head's K scale, row 1
    its V scale, and an element stands for ``element * scale``.
    ``seq_lens`` values are checked on the host only when they are there already (on CPU);
    on a GPU that would sync. ``tiling``: for benchmarks that compare tilings; the default is
    the engine's.

    Raises ValueError naming the argument on a wrong shape, dtype, device or layout.
    """
    _check_decode_args(query, kv_cache_layer, block_tables, seq_lens)
    require_kv_scales(kv_scales, kv_cache_layer)
    num_rows, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache_layer.shape
    capacity = block_tables.shape[1] * block_size
    if max_seq_len is None:
        max_seq_len = capacity
    require(
        1 <= max_seq_len <= capacity,
        f"max_seq_len must be in [1, max_blocks * block_size = {capacity}], got {max_seq_len}",
    )
    _check_tiling(tiling)
    _check_sliding_window(sliding_window)
    require_softcap(logit_softcap)
    require_sinks(sinks, query)
    num_groups = num_rows if row_starts is None else len(row_starts) - 1
    require(max_rows_per_seq >= 1, f"max_rows_per_seq must be >= 1, got {max_rows_per_seq}")
    if row_starts is not None:
        _check_row_starts(row_starts, seq_lens, max_rows_per_seq)
    if tokens_per_split is not None:
        require(num_splits is None, "give num_splits or tokens_per_split, not both")
        require(tokens_per_split >= 1, f"tokens_per_split must be >= 1, got {tokens_per_split}")
        tokens_per_split = _whole_tiles(tokens_per_split, tiling.max_tile)
        num_splits = -(-max_seq_len // tokens_per_split)
    else:
        if num_splits is None:
            num_splits = default_num_splits(max_seq_len, num_groups, num_kv_heads)
        require(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
        tokens_per_split = _whole_tiles(-(-max_seq_len // num_splits), tiling.max_tile)
    tile = _tile(tokens_per_split, tiling.max_tile)
    if seq_lens.device.type == "cpu":  # (on a GPU the check would wait for the device)
        _check_seq_lens_values(seq_lens, max_seq_len)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out
    # [num_rows, num_heads, num_splits(, head_dim)] f32; unused (tiny) with one partition
    part_shape = (num_rows, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    part_out = query.new_empty((*part_shape, head_dim), dtype=torch.float32)
    part_max = query.new_empty(part_shape, dtype=torch.float32)
    part_sum = query.new_empty(part_shape, dtype=torch.float32)
    group_size = num_heads // num_kv_heads
    head_dim_pad = max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    folded = row_starts is not None
    rows_per_seq = max_rows_per_seq if folded else 1
    _decode_partition_kernel[(num_groups, num_kv_heads, num_splits)](
        query,
        kv_cache_layer,
        block_tables,
        seq_lens,
        seq_lens if row_starts is None else row_starts,  # (not read unless folded)
        out,
        part_out,
        part_max,
        part_sum,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        num_blocks * block_size * num_kv_heads * head_dim,
        scale * LOG2_E,
        tokens_per_split,
        sliding_window or 0,
        (logit_softcap or 0.0) * LOG2_E,
        query if sinks is None else sinks,  # (not read without sinks)
        query if kv_scales is None else kv_scales,  # (not read unless quantized)
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        TILE_ROWS=max(_MIN_DOT_DIM, triton.next_power_of_2(rows_per_seq * group_size)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=tile,
        NUM_SPLITS=num_splits,
        FOLDED=folded,
        WINDOWED=sliding_window is not None,
        SOFTCAP=logit_softcap is not None,
        SINKS=sinks is not None,
        # Triton 3.9's interpreter multiplies bf16 dot operands as raw uint16 bits
        DOT_FP32=interpreted() or query.dtype == torch.float32,
        KV_QUANTIZED=kv_scales is not None,
        num_warps=tiling.num_warps,
    )
    if num_splits > 1:
        merge_partitions_kernel[(num_rows, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            seq_lens,
            tokens_per_split,
            sliding_window or 0,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            WINDOWED=sliding_window is not None,
        )
    return out


def _check_seq_lens_values(seq_lens: torch.Tensor, max_seq_len: int) -> None:
    if len(seq_lens) == 0:
        return
    shortest, longest = int(seq_lens.min()), int(seq_lens.max())
    require(shortest >= 1, f"seq_lens must be >= 1, got {shortest}")
    require(
        longest <= max_seq_len,
        f"seq_lens must be <= max_seq_len = {max_seq_len} (max_blocks * block_size when not "
        f"given), got {longest}",
    )


def _check_row_starts(
    row_starts: torch.Tensor, seq_lens: torch.Tensor, max_rows_per_seq: int
) -> None:
    num_rows = seq_lens.shape[0]
    require(
        row_starts.dim() == 1 and row_starts.shape[0] >= 1,
        f"row_starts must be [num_groups + 1], got {tuple(row_starts.shape)}",
    )
    require(
        row_starts.dtype in INDEX_DTYPES,
        f"row_starts must be int32 or int64, got {row_starts.dtype}",
    )
    require(row_starts.is_contiguous(), "row_starts must be contiguous")
    require_same_device(seq_lens, row_starts=row_starts)
    if row_starts.device.type != "cpu":  # (on a GPU the values would wait for the device)
        return
    starts = row_starts.tolist()
    sizes = [end - start for start, end in zip(starts[:-1], starts[1:])]
    require(
        starts[0] == 0 and starts[-1] == num_rows and all(size >= 0 for size in sizes),
        f"row_starts must rise from 0 to num_rows = {num_rows}, got {starts}",
    )
    require(
        max(sizes, default=0) <= max_rows_per_seq,
        f"a group of row_starts has {max(sizes, default=0)} rows > max_rows_per_seq = "
        f"{max_rows_per_seq}",
    )
    lens = seq_lens.tolist()
    for start, end in zip(starts[:-1], starts[1:]):
        require(
            all(lens[row + 1] == lens[row] + 1 for row in range(start, end - 1)),
            f"the rows {start}..{end} of a group must see one token more each, got "
            f"seq_lens {lens[start:end]}",
        )


def _check_sliding_window(sliding_window: int | None) -> None:
    require(
        sliding_window is None or sliding_window >= 1,
        f"sliding_window must be >= 1 or None, got {sliding_window}",
    )


def _check_tiling(tiling: DecodeTiling) -> None:
    require_power_of_two("tiling.max_tile", tiling.max_tile, 16)
    require_power_of_two("tiling.num_warps", tiling.num_warps, 1)


def _check_decode_args(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    require_kv_cache_layer(kv_cache_layer)
    _, _, _, num_kv_heads, head_dim = kv_cache_layer.shape
    require(
        query.dim() == 3 and query.shape[2] == head_dim,
        f"query must be [num_seqs, num_heads, {head_dim}] to match kv_cache_layer, "
        f"got {tuple(query.shape)}",
    )
    num_seqs, num_heads, _ = query.shape
    require(
        num_heads % num_kv_heads == 0,
        f"query's num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    if is_quantized_cache(kv_cache_layer):
        require(
            query.dtype in FLOAT_DTYPES,
            f"query dtype must be float32, float16 or bfloat16, got {query.dtype}",
        )
    else:
        require(
            query.dtype == kv_cache_layer.dtype,
            f"query dtype {query.dtype} != kv_cache_layer dtype {kv_cache_layer.dtype}",
        )
    require(query.stride(2) == 1, f"query must be contiguous in head_dim ({query.stride()})")
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}",
    )
    require(block_tables.shape[1] >= 1, "block_tables must have at least one column")
    require(
        block_tables.dtype in INDEX_DTYPES,
        f"block_tables must be int32 or int64, got {block_tables.dtype}",
    )
    require(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    require(
        seq_lens.shape == (num_seqs,),
        f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}",
    )
    require(
        seq_lens.dtype in INDEX_DTYPES, f"seq_lens must be int32 or int64, got {seq_lens.dtype}"
    )
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    require_same_device(kv_cache_layer, query=query, block_tables=block_tables, seq_lens=seq_lens)
