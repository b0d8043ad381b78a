"""Triton kernels for multi-head latent attention (DeepSeek) over a paged latent cache.

The cache holds one entry per token, ``[1, num_blocks, block_size, 1, width]`` (contiguous): the
token's latent (its first ``value_dim`` elements), then its rotary key (``rope_dim = width -
value_dim``). Attention runs in the absorbed form, as MQA with one KV head: query head ``h`` of
a new token scores each context entry whole, ``scale * q[h] @ entry``, and its output is the
softmax-weighted sum of the entries' latents, ``[value_dim]``. The width (576 = 512 + 64 in
DeepSeek-V2/V3) is no power of two, so every dot is two: the latent part and the rotary part,
each over a power-of-two tile whose extra columns are masked. A K tile's latent part is also
its V tile: each entry is read once per program. Dots accumulate in float32; the softmax runs
in base 2 (``exp2``, logits times log2(e)).

The kernels, behind ``write_latent_cache``, ``latent_decode_attention`` and
``latent_prefill_attention``:

- ``_write_latent_kernel``, grid ``(num_tokens,)``: a program copies one token's entry into
  its slot; a negative slot marks a padding row, which writes nothing.
- ``_latent_decode_kernel``, grid ``(num_rows, num_head_blocks, num_splits)``: flash-decoding.
  A program takes one decode row (a token of context ``seq_len``), ``decode_heads`` of its
  query heads (the rows of its dot tiles, >= 16; heads past ``num_heads`` masked) and one
  partition of ``tokens_per_split`` context positions, which it walks in tiles of ``tile``
  positions, each position's slot looked up through the row's block table, with an online
  softmax. With one partition it writes the output; else its normalised partial output, max
  logit and sum of exp, which ``paged_decode_attention.merge_partitions_kernel`` (grid
  ``(num_rows, num_heads)``) merges in order over the row's own partitions: a row's bits
  depend on ``tokens_per_split``, never on the grid's partition count.
- ``_latent_prefill_kernel``, grid ``(query tile, sequence, head block)``: varlen, causal.
  Sequence ``s`` has new tokens ``query_start_loc[s] .. query_start_loc[s + 1]`` at the end of
  its ``seq_lens[s]``-token context (the mask aligned bottom-right: new token ``i`` of ``q_len``
  sees positions ``<= seq_len - q_len + i``). A program flattens ``prefill_rows // heads``
  new tokens times ``heads`` query heads (``heads``: ``num_heads`` padded to a power of two, or
  ``prefill_rows`` of them when there are more; ``prefill_rows`` is halved for float32) into
  the rows of its tiles, and walks the context tiles up to its last token's causal limit; the
  tiles below its first token's diagonal skip the mask. Query tiles are handed out last-first,
  the longest programs first.

A quantized cache (float8 e4m3 or int8 elements, engine/kv_cache/kv_quantization.py) has one
scale per layer for the whole entries (``kv_scales``, [1, 1] float32). The write kernel stores
each element as ``quantize_kv`` does, to the bit (divided by the scale in IEEE float32, rounded
by kv_cache_write.py's integer arithmetic, not Triton's casts). The attention kernels read the
1-byte elements exactly, in the dot's type (the query's, or float32), and fold the scale in
where it is exact enough: into the logits' factor (``q . (e * s) = (q . e) * s``) and into the
output (the softmax-weighted sum of the latents, times ``s``).
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
    QUANTIZED_KV_DTYPES,
    interpreted,
    is_quantized_cache,
    require,
    require_kv_scales,
    require_power_of_two,
    require_prefill_index_tensors,
    require_prefill_offsets,
    require_same_device,
)
from engine.kernels.kv_cache_write import to_float8e4nv, to_int8
from engine.kernels.paged_decode_attention import default_num_splits, merge_partitions_kernel

_MIN_DOT_DIM = 16  # tl.dot wants every dimension >= 16


@dataclass(frozen=True, slots=True)
class LatentTiling:
    """How the attention kernels cut their work; the defaults are what the engine runs."""

    decode_heads: int = 16  # query heads per decode program (a power of two >= 16)
    # (new token, query head) rows per prefill program (a power of two >= 16); halved for float32
    prefill_rows: int = 32
    tile: int = 32  # context positions per inner-loop tile (a power of two >= 16)
    num_warps: int | None = None  # None: 8 for a latent of more than 128 elements, else 4


@triton.jit
def _write_latent_kernel(
    cache_ptr,  # [num_slots, WIDTH], contiguous
    entries_ptr,  # [num_tokens, WIDTH], last dim contiguous
    slot_mapping_ptr,  # [num_tokens]
    kv_scales_ptr,  # [1] f32: the layer's scale (read only when QUANTIZED)
    entries_stride_token,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,  # next power of two of WIDTH
    QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8: quantize by the scale
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dims = tl.arange(0, WIDTH_PAD)
    # a padding row (slot < 0) writes no element
    mask = dims < tl.where(slot >= 0, WIDTH, 0)
    entry = tl.load(entries_ptr + token * entries_stride_token + dims, mask=mask)
    if QUANTIZED:
        # divided in float32 as IEEE division rounds (a plain `/` is approximate), then
        # rounded as quantize_kv rounds
        scale = tl.load(kv_scales_ptr + dims * 0)  # [WIDTH_PAD]: the one scale, everywhere
        scaled = tl.math.div_rn(entry.to(tl.float32), scale)
        if cache_ptr.dtype.element_ty == tl.int8:  # noqa: SIM108 (a branch Triton resolves at compile)
            entry = to_int8(scaled)
        else:
            entry = to_float8e4nv(scaled)
    tl.store(cache_ptr + slot * WIDTH + dims, entry, mask=mask)


@triton.jit
def _attend_latent_tile(
    q_value,  # [ROWS, VALUE_PAD]: the rows' queries, latent part
    q_rope,  # [ROWS, ROPE_PAD]: rotary part
    acc,  # [ROWS, VALUE_PAD] float32
    m_i,  # [ROWS] float32: running max logit (base 2)
    l_i,  # [ROWS] float32: running sum of exp2(logit - m_i)
    row_limit,  # [ROWS]: a row sees positions < row_limit (read only when MASK)
    tile_start,
    kv_end,  # positions >= kv_end are not read
    table,  # the sequence's block-table row
    cache_ptr,  # [num_slots, VALUE_DIM + ROPE_DIM]
    query_ptr,  # (its element type: p is rounded to it for the second dot)
    scale_log2,
    VALUE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    VALUE_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8 elements
    MASK: tl.constexpr,  # some row does not see the whole tile
):
    """One context tile's online-softmax update of the rows' running max, sum and output."""
    positions = tile_start + tl.arange(0, TILE)  # [TILE]
    valid = positions < kv_end
    block_ids = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    entries = cache_ptr + (block_ids * BLOCK_SIZE + positions % BLOCK_SIZE) * (VALUE_DIM + ROPE_DIM)
    value_dims = tl.arange(0, VALUE_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    value_mask = valid[:, None] & (value_dims < VALUE_DIM)[None, :]
    kv_value = tl.load(entries[:, None] + value_dims[None, :], mask=value_mask, other=0.0)
    if QUANTIZED:  # the stored elements, exactly, in the dot's type; the scale is folded in
        kv_value = kv_value.to(q_value.dtype)
    elif UPCAST_DOT:
        kv_value = kv_value.to(tl.float32)  # [TILE, VALUE_PAD]: keys' latent part and values
    scores = tl.dot(q_value, tl.trans(kv_value), input_precision=DOT_PRECISION)  # [ROWS, TILE]
    if ROPE_DIM > 0:
        rope_mask = valid[:, None] & (rope_dims < ROPE_DIM)[None, :]
        kv_rope = tl.load(
            entries[:, None] + VALUE_DIM + rope_dims[None, :], mask=rope_mask, other=0.0
        )
        if QUANTIZED:
            kv_rope = kv_rope.to(q_rope.dtype)
        elif UPCAST_DOT:
            kv_rope = kv_rope.to(tl.float32)  # [TILE, ROPE_PAD]
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores, input_precision=DOT_PRECISION)
    scores = scores * scale_log2
    if MASK:
        scores = tl.where(positions[None, :] < row_limit[:, None], scores, float("-inf"))
    # every row sees the first position of its walk, so m_new is finite from the first tile on
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p rounded to the query's dtype, as a tensor-core dot takes it
    p = p.to(query_ptr.dtype.element_ty).to(kv_value.dtype)
    acc = tl.dot(p, kv_value, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _latent_decode_kernel(
    query_ptr,  # [num_rows, NUM_HEADS, VALUE_DIM + ROPE_DIM], last dim contiguous
    cache_ptr,  # [num_slots, VALUE_DIM + ROPE_DIM], contiguous
    block_tables_ptr,  # [num_rows, max_blocks], last dim contiguous
    seq_lens_ptr,  # [num_rows]: each row's context, itself included
    out_ptr,  # [num_rows, NUM_HEADS, VALUE_DIM], contiguous: written only when NUM_SPLITS == 1
    part_out_ptr,  # [num_rows, NUM_HEADS, NUM_SPLITS, VALUE_DIM] f32, normalised per partition
    part_max_ptr,  # [num_rows, NUM_HEADS, NUM_SPLITS] f32: max logit * log2(e)
    part_sum_ptr,  # [num_rows, NUM_HEADS, NUM_SPLITS] f32: sum of exp2(logit - max)
    kv_scales_ptr,  # [1] f32: the layer's scale (read only when QUANTIZED)
    query_stride_row,
    query_stride_head,
    block_tables_stride_row,
    scale_log2,  # softmax scale * log2(e)
    tokens_per_split,  # a multiple of TILE
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program, a power of two >= 16
    VALUE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    VALUE_PAD: tl.constexpr,  # power of two >= max(VALUE_DIM, 16)
    ROPE_PAD: tl.constexpr,  # power of two >= max(ROPE_DIM, 16)
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # run the dots in float32 (the interpreter's bfloat16 dot is wrong)
    QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8 elements
):
    row = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < NUM_HEADS
    value_dims = tl.arange(0, VALUE_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    q_rows = query_ptr + row * query_stride_row + heads[:, None] * query_stride_head
    value_mask = head_mask[:, None] & (value_dims < VALUE_DIM)[None, :]
    rope_mask = head_mask[:, None] & (rope_dims < ROPE_DIM)[None, :]
    q_value = tl.load(q_rows + value_dims[None, :], mask=value_mask, other=0.0)
    q_rope = tl.load(q_rows + VALUE_DIM + rope_dims[None, :], mask=rope_mask, other=0.0)
    if UPCAST_DOT:
        q_value = q_value.to(tl.float32)  # [BLOCK_H, VALUE_PAD]
        q_rope = q_rope.to(tl.float32)  # [BLOCK_H, ROPE_PAD]
    if QUANTIZED:  # q . (e * s) = (q . e) * s; s scales the output too
        kv_scale = tl.load(kv_scales_ptr)
        scale_log2 = scale_log2 * kv_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, VALUE_PAD], tl.float32)
    row_limit = tl.full([BLOCK_H], 0, tl.int32) + split_end
    table = block_tables_ptr + row * block_tables_stride_row
    for tile_start in range(split_start, split_end, TILE):
        m_i, l_i, acc = _attend_latent_tile(
            q_value, q_rope, acc, m_i, l_i, row_limit, tile_start, split_end, table, cache_ptr,
            query_ptr, scale_log2, VALUE_DIM, ROPE_DIM, VALUE_PAD, ROPE_PAD, BLOCK_SIZE, TILE,
            DOT_PRECISION, UPCAST_DOT, QUANTIZED, True,
        )  # fmt: skip

    if QUANTIZED:
        acc = acc * kv_scale
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only past the row's context
    out_rows = row * NUM_HEADS + heads  # [BLOCK_H]
    if NUM_SPLITS == 1:
        out_offsets = out_rows[:, None] * VALUE_DIM + value_dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=value_mask)
    else:
        # a partition past the row's context is written empty (max -inf, sum 0), never merged
        part_rows = out_rows * NUM_SPLITS + split
        part_offsets = part_rows[:, None] * VALUE_DIM + value_dims[None, :]
        tl.store(part_out_ptr + part_offsets, out, mask=value_mask)
        tl.store(part_max_ptr + part_rows, m_i, mask=head_mask)
        tl.store(part_sum_ptr + part_rows, l_i, mask=head_mask)


@triton.jit
def _latent_prefill_kernel(
    query_ptr,  # [num_tokens, NUM_HEADS, VALUE_DIM + ROPE_DIM], last dim contiguous
    cache_ptr,  # [num_slots, VALUE_DIM + ROPE_DIM], contiguous
    out_ptr,  # [num_tokens, NUM_HEADS, VALUE_DIM], contiguous
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]: each sequence's context after this step
    block_tables_ptr,  # [num_seqs, max_blocks], last dim contiguous
    kv_scales_ptr,  # [1] f32: the layer's scale (read only when QUANTIZED)
    query_stride_token,
    query_stride_head,
    block_tables_stride_row,
    scale_log2,  # softmax scale * log2(e)
    NUM_HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_H: tl.constexpr,  # query heads per program, a power of two
    VALUE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    VALUE_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8 elements
):
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # last tiles (most work) first
    seq = tl.program_id(1)
    head_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len  # context cached before this step's tokens

    # row r: new token r // BLOCK_H of the tile, query head r % BLOCK_H of the head block
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    token = q_tile * BLOCK_Q + rows // BLOCK_H  # [ROWS] index among the sequence's new tokens
    heads = head_block * BLOCK_H + rows % BLOCK_H
    row_mask = (token < q_len) & (heads < NUM_HEADS)
    value_dims = tl.arange(0, VALUE_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    q_rows = query_ptr + (q_start + token) * query_stride_token + heads * query_stride_head
    value_mask = row_mask[:, None] & (value_dims < VALUE_DIM)[None, :]
    rope_mask = row_mask[:, None] & (rope_dims < ROPE_DIM)[None, :]
    q_value = tl.load(q_rows[:, None] + value_dims[None, :], mask=value_mask, other=0.0)
    q_rope = tl.load(q_rows[:, None] + VALUE_DIM + rope_dims[None, :], mask=rope_mask, other=0.0)
    if UPCAST_DOT:
        q_value = q_value.to(tl.float32)  # [ROWS, VALUE_PAD]
        q_rope = q_rope.to(tl.float32)  # [ROWS, ROPE_PAD]
    if QUANTIZED:  # q . (e * s) = (q . e) * s; s scales the output too
        kv_scale = tl.load(kv_scales_ptr)
        scale_log2 = scale_log2 * kv_scale

    # positions < diag_start are seen by every row; the program's last token sees < kv_end
    first_pos = prefix_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    diag_start = (first_pos + 1) // TILE * TILE
    row_limit = tl.minimum(prefix_len + token + 1, kv_end)  # rows past q_len: kv_end
    table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride_row
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, VALUE_PAD], tl.float32)
    for tile_start in range(0, diag_start, TILE):
        m_i, l_i, acc = _attend_latent_tile(
            q_value, q_rope, acc, m_i, l_i, row_limit, tile_start, kv_end, table, cache_ptr,
            query_ptr, scale_log2, VALUE_DIM, ROPE_DIM, VALUE_PAD, ROPE_PAD, BLOCK_SIZE, TILE,
            DOT_PRECISION, UPCAST_DOT, QUANTIZED, False,
        )  # fmt: skip
    for tile_start in range(diag_start, kv_end, TILE):
        m_i, l_i, acc = _attend_latent_tile(
            q_value, q_rope, acc, m_i, l_i, row_limit, tile_start, kv_end, table, cache_ptr,
            query_ptr, scale_log2, VALUE_DIM, ROPE_DIM, VALUE_PAD, ROPE_PAD, BLOCK_SIZE, TILE,
            DOT_PRECISION, UPCAST_DOT, QUANTIZED, True,
        )  # fmt: skip

    if QUANTIZED:
        acc = acc * kv_scale
    out = acc / l_i[:, None]
    out_rows = (q_start + token) * NUM_HEADS + heads  # [ROWS]
    out_offsets = out_rows[:, None] * VALUE_DIM + value_dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=value_mask)


def write_latent_cache(
    cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
    entries: torch.Tensor,  # [num_tokens, width]
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64; < 0: a padding row, skipped
    kv_scales: torch.Tensor | None = None,  # [1, 1] f32: a quantized cache's
) -> None:
    """Write each token's entry into ``cache_layer`` in place at its slot of ``slot_mapping``
    (``block_id * block_size + offset``); rows with a negative slot are skipped. Into a
    float8_e4m3fn or int8 cache, quantized by ``kv_scales`` (given exactly when the cache is
    quantized) as ``quantize_kv`` does, to the bit.

    Raises ValueError naming the argument on a wrong shape, dtype, device or layout. Slots
    must be < num_blocks * block_size: checked on the host only when they are there already
    (on CPU); on a GPU the check would sync.
    """
    _check_cache(cache_layer, kv_scales)
    width = cache_layer.shape[4]
    require(
        entries.dim() == 2 and entries.shape[1] == width,
        f"entries must be [num_tokens, {width}] to match cache_layer, got {tuple(entries.shape)}",
    )
    if is_quantized_cache(cache_layer):
        require(
            entries.dtype in FLOAT_DTYPES,
            f"entries dtype must be float32, float16 or bfloat16, got {entries.dtype}",
        )
    else:
        require(
            entries.dtype == cache_layer.dtype,
            f"entries dtype {entries.dtype} != cache_layer dtype {cache_layer.dtype}",
        )
    require(entries.stride(1) == 1, f"entries must be contiguous in width ({entries.stride()})")
    num_tokens = entries.shape[0]
    require(
        slot_mapping.shape == (num_tokens,),
        f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}",
    )
    require(
        slot_mapping.dtype in INDEX_DTYPES,
        f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}",
    )
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    require_same_device(cache_layer, "cache_layer", entries=entries, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    num_slots = cache_layer.shape[1] * cache_layer.shape[2]
    if slot_mapping.device.type == "cpu":  # (on a GPU the check would wait for the device)
        highest = int(slot_mapping.max())
        require(
            highest < num_slots,
            f"slot_mapping must be < num_blocks * block_size = {num_slots}, got {highest}",
        )
    _write_latent_kernel[(num_tokens,)](
        cache_layer,
        entries,
        slot_mapping,
        slot_mapping if kv_scales is None else kv_scales,  # (not read unless quantized)
        entries.stride(0),
        WIDTH=width,
        WIDTH_PAD=triton.next_power_of_2(width),
        QUANTIZED=kv_scales is not None,
    )


def latent_decode_head_blocks(num_heads: int, tiling: LatentTiling = LatentTiling()) -> int:
    """Decode programs per (row, partition): the query heads cut into blocks."""
    return -(-num_heads // tiling.decode_heads)


def latent_decode_attention(
    query: torch.Tensor,  # [num_rows, num_heads, width]
    cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
    block_tables: torch.Tensor,  # [num_rows, max_blocks] int32 or int64, padded
    seq_lens: torch.Tensor,  # [num_rows] int32 or int64, each in [1, max_blocks * block_size]
    scale: float,
    value_dim: int,
    *,
    max_seq_len: int | None = None,
    tokens_per_split: int | None = None,
    tiling: LatentTiling = LatentTiling(),
    kv_scales: torch.Tensor | None = None,  # [1, 1] f32: a quantized cache's
) -> torch.Tensor:  # [num_rows, num_heads, value_dim], query's dtype
    """Attention of each decode row's token over its whole context of latent entries.

    ``max_seq_len``: an upper bound on ``seq_lens`` known on the host; None takes
    ``max_blocks * block_size``. Understating it drops tokens. The context is cut into
    partitions of ``tokens_per_split`` positions (rounded up to whole tiles), as many as
    ``max_seq_len`` needs; a row's result depends only on its own partitions, so any bound
    gives the same bits. None: ``default_num_splits`` partitions of the bound.
    ``seq_lens`` values are checked on the host only when they are there already (on CPU).
    ``kv_scales``: given exactly when the cache stores float8_e4m3fn or int8 elements, read as
    ``element * scale``.
    Raises ValueError naming the argument on a wrong shape, dtype, device or layout.
    """
    _check_attention_args(query, cache_layer, value_dim, tiling, kv_scales)
    _check_decode_index(query, block_tables, seq_lens)
    num_rows, num_heads, width = query.shape
    block_size = cache_layer.shape[2]
    capacity = block_tables.shape[1] * block_size
    max_seq_len = capacity if max_seq_len is None else max_seq_len
    require(
        1 <= max_seq_len <= capacity,
        f"max_seq_len must be in [1, max_blocks * block_size = {capacity}], got {max_seq_len}",
    )
    if seq_lens.device.type == "cpu" and num_rows > 0:
        shortest, longest = int(seq_lens.min()), int(seq_lens.max())
        require(
            shortest >= 1 and longest <= max_seq_len,
            f"seq_lens must be in [1, max_seq_len = {max_seq_len}], got {shortest}..{longest}",
        )
    num_head_blocks = latent_decode_head_blocks(num_heads, tiling)
    if tokens_per_split is None:
        num_splits = default_num_splits(max_seq_len, num_rows, num_head_blocks)
        tokens_per_split = -(-max_seq_len // num_splits)
    require(tokens_per_split >= 1, f"tokens_per_split must be >= 1, got {tokens_per_split}")
    tokens_per_split = -(-tokens_per_split // tiling.tile) * tiling.tile
    num_splits = -(-max_seq_len // tokens_per_split)
    out = query.new_empty(num_rows, num_heads, value_dim)
    if num_rows == 0:
        return out
    # [num_rows, num_heads, num_splits(, value_dim)] f32; unused (tiny) with one partition
    part_shape = (num_rows, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    part_out = query.new_empty((*part_shape, value_dim), dtype=torch.float32)
    part_max = query.new_empty(part_shape, dtype=torch.float32)
    part_sum = query.new_empty(part_shape, dtype=torch.float32)
    value_pad, rope_pad = _pads(width, value_dim)
    _latent_decode_kernel[(num_rows, num_head_blocks, num_splits)](
        query,
        cache_layer,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_max,
        part_sum,
        query if kv_scales is None else kv_scales,  # (not read unless quantized)
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        scale * LOG2_E,
        tokens_per_split,
        NUM_HEADS=num_heads,
        BLOCK_H=tiling.decode_heads,
        VALUE_DIM=value_dim,
        ROPE_DIM=width - value_dim,
        VALUE_PAD=value_pad,
        ROPE_PAD=rope_pad,
        BLOCK_SIZE=block_size,
        TILE=tiling.tile,
        NUM_SPLITS=num_splits,
        QUANTIZED=kv_scales is not None,
        **_dot_options(query.dtype, value_pad, tiling),
    )
    if num_splits > 1:
        merge_partitions_kernel[(num_rows, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            seq_lens,
            tokens_per_split,
            0,  # (no sliding window)
            NUM_HEADS=num_heads,
            HEAD_DIM=value_dim,
            HEAD_DIM_PAD=value_pad,
            NUM_SPLITS=num_splits,
            WINDOWED=False,
        )
    return out


def latent_prefill_attention(
    query: torch.Tensor,  # [num_prefill_tokens, num_heads, width]
    cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64 row offsets into query
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64 context length after this step
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64, padded
    scale: float,
    value_dim: int,
    max_query_len: int,
    tiling: LatentTiling = LatentTiling(),
    kv_scales: torch.Tensor | None = None,  # [1, 1] f32: a quantized cache's
) -> torch.Tensor:  # [num_prefill_tokens, num_heads, value_dim], query's dtype
    """Causal attention of each prefill sequence's new tokens over its whole context of latent
    entries, its new tokens' already written. ``kv_scales``: as in ``latent_decode_attention``.

    Raises ValueError naming the argument when shapes, dtypes, devices, strides or the
    offsets disagree. The offsets' values are checked only on CPU (the interpreter): on a GPU
    reading them back would sync every call, so there they are the caller's contract.
    """
    _check_attention_args(query, cache_layer, value_dim, tiling, kv_scales)
    require_prefill_index_tensors(
        query, cache_layer, query_start_loc, seq_lens, block_tables, "cache_layer"
    )
    require_prefill_offsets(
        query, cache_layer, query_start_loc, seq_lens, block_tables, max_query_len
    )
    num_tokens, num_heads, width = query.shape
    num_seqs = seq_lens.shape[0]
    out = query.new_empty(num_tokens, num_heads, value_dim)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_rows = tiling.prefill_rows if query.element_size() <= 2 else tiling.prefill_rows // 2
    num_rows = max(_MIN_DOT_DIM, num_rows)
    block_h = min(triton.next_power_of_2(num_heads), num_rows)
    block_q = num_rows // block_h
    value_pad, rope_pad = _pads(width, value_dim)
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, -(-num_heads // block_h))
    _latent_prefill_kernel[grid](
        query,
        cache_layer,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        query if kv_scales is None else kv_scales,  # (not read unless quantized)
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        scale * LOG2_E,
        NUM_HEADS=num_heads,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        VALUE_DIM=value_dim,
        ROPE_DIM=width - value_dim,
        VALUE_PAD=value_pad,
        ROPE_PAD=rope_pad,
        BLOCK_SIZE=cache_layer.shape[2],
        TILE=tiling.tile,
        QUANTIZED=kv_scales is not None,
        **_dot_options(query.dtype, value_pad, tiling),
    )
    return out


def _pads(width: int, value_dim: int) -> tuple[int, int]:
    """Power-of-two tile widths (>= 16, as tl.dot wants) of the latent and the rotary part."""
    rope_dim = width - value_dim
    return (
        max(_MIN_DOT_DIM, triton.next_power_of_2(value_dim)),
        max(_MIN_DOT_DIM, triton.next_power_of_2(rope_dim)),
    )


def _dot_options(dtype: torch.dtype, value_pad: int, tiling: LatentTiling) -> dict[str, object]:
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # the interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584)
        "UPCAST_DOT": interpreted() and dtype == torch.bfloat16,
        "num_warps": tiling.num_warps or (8 if value_pad > 128 else 4),
    }


def _check_cache(cache_layer: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    require(
        cache_layer.dim() == 5 and cache_layer.shape[0] == 1 and cache_layer.shape[3] == 1,
        "cache_layer must be [1, num_blocks, block_size, 1, width], "
        f"got {tuple(cache_layer.shape)}",
    )
    require(cache_layer.is_contiguous(), "cache_layer must be contiguous")
    require(
        cache_layer.dtype in FLOAT_DTYPES + QUANTIZED_KV_DTYPES,
        "cache_layer dtype must be float32, float16, bfloat16, float8_e4m3fn or int8, got "
        f"{cache_layer.dtype}",
    )
    require_kv_scales(kv_scales, cache_layer)


def _check_attention_args(
    query: torch.Tensor,
    cache_layer: torch.Tensor,
    value_dim: int,
    tiling: LatentTiling,
    kv_scales: torch.Tensor | None,
) -> None:
    _check_cache(cache_layer, kv_scales)
    width = cache_layer.shape[4]
    require(
        query.dim() == 3 and query.shape[2] == width,
        f"query must be [num_tokens, num_heads, {width}] to match cache_layer, "
        f"got {tuple(query.shape)}",
    )
    if is_quantized_cache(cache_layer):
        require(
            query.dtype in FLOAT_DTYPES,
            f"query dtype must be float32, float16 or bfloat16, got {query.dtype}",
        )
    else:
        require(
            query.dtype == cache_layer.dtype,
            f"query dtype {query.dtype} != cache_layer dtype {cache_layer.dtype}",
        )
    require(query.stride(2) == 1, f"query must be contiguous in width ({query.stride()})")
    require_same_device(cache_layer, "cache_layer", query=query)
    require(1 <= value_dim <= width, f"value_dim must be in [1, width = {width}], got {value_dim}")
    require_power_of_two("tiling.decode_heads", tiling.decode_heads, _MIN_DOT_DIM)
    require_power_of_two("tiling.prefill_rows", tiling.prefill_rows, _MIN_DOT_DIM)
    require_power_of_two("tiling.tile", tiling.tile, _MIN_DOT_DIM)
    if tiling.num_warps is not None:
        require_power_of_two("tiling.num_warps", tiling.num_warps, 1)


def _check_decode_index(
    query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    num_rows = query.shape[0]
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_rows,
        f"block_tables must be [num_rows={num_rows}, max_blocks], got {tuple(block_tables.shape)}",
    )
    require(block_tables.shape[1] >= 1, "block_tables must have at least one column")
    require(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    require(
        seq_lens.shape == (num_rows,),
        f"seq_lens must be [num_rows={num_rows}], got {tuple(seq_lens.shape)}",
    )
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    for name, index in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        require(index.dtype in INDEX_DTYPES, f"{name} must be int32 or int64, got {index.dtype}")
    require_same_device(query, "query", block_tables=block_tables, seq_lens=seq_lens)
