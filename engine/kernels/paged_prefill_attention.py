"""Triton prefill attention over the paged KV cache, for a batch of variable-length prompts.

Each prefill sequence has ``q_len`` new tokens (rows ``query_start_loc[s] ..
query_start_loc[s + 1]`` of ``query``) and a context of ``seq_len`` tokens, all of them already
in the paged cache (a cached prefix from an earlier chunk or a prefix-cache hit, then the new
tokens). New token ``i`` sits at absolute position ``p = seq_len - q_len + i`` and attends,
causally, to context positions ``0 .. p`` (the mask is aligned bottom-right); with a sliding
window of ``W`` tokens, to ``max(0, p - W + 1) .. p``. With a logit soft-cap ``c`` each logit
``scale * q . k`` becomes ``c * tanh(logit / c)`` before the mask; with attention sinks, head
``h``'s logit ``sinks[h]`` joins its softmax's denominator as a position with no value (each
row's running max starts at it, its running sum at 1). A quantized cache (float8 e4m3 or int8
elements, as engine/kv_cache/kv_quantization.py stores them) is read as what its elements stand
for, ``element * scale`` with the KV head's K and V scales: the elements, exact in the query's
dtype, go into the dots, the K scale into the logits' scale and the V scale into the output.

Program layout: grid ``(query tile, sequence, kv head)``. One program takes ``BLOCK_Q`` new
tokens of one sequence times the ``group = num_heads // num_kv_heads`` query heads that share
one KV head, flattened into ``BLOCK_M = BLOCK_Q * group_pad`` rows (row ``r`` is token
``r // group_pad``, head ``r % group_pad`` of the group; ``group_pad`` is ``group`` rounded up
to a power of two and its extra rows are masked). So each K/V tile is loaded once per group
(GQA), not once per query head. The program walks the KV tiles of ``BLOCK_N`` positions up to
the causal limit of its last token, gathering each position's slot through the block table,
with a float32 online softmax (flash attention); tiles wholly below the diagonal skip the
mask, tiles past the causal limit are never read. With a window the walk starts at the window
start of the program's first token (nothing before it is read: its blocks may be freed); the
tiles that reach below a later token's window start mask each row to its own window. Query
tiles are handed out last-first, so the longest programs start first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.checks import (
    FLOAT_DTYPES,
    LOG2_E,
    interpreted,
    is_quantized_cache,
    require,
    require_kv_cache_layer,
    require_kv_scales,
    require_power_of_two,
    require_prefill_index_tensors,
    require_prefill_offsets,
    require_sinks,
    require_softcap,
)

_LOG2_E: tl.constexpr = tl.constexpr(LOG2_E)


@dataclass(frozen=True, slots=True)
class PrefillTiling:
    """How the kernel cuts its work; the defaults are what the engine runs."""

    block_m: int = 128  # rows (new tokens x padded group heads) per program
    block_n: int = 64  # KV positions per tile; halved for float32
    num_warps: int | None = None  # None: 8 for tiles of >= 128 x 128 query elements, else 4
    num_stages: int = 2  # software-pipelining depth of the KV loop


def paged_prefill_attention(
    query: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64 row offsets into query
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64 context length after this step
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64, padded
    scale: float,
    max_query_len: int,
    tiling: PrefillTiling = PrefillTiling(),
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] float32: a quantized cache's
) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim], query's dtype
    """Causal attention of each prefill sequence's new tokens over its whole paged context.

    ``sliding_window`` W: the token at position ``p`` sees only positions ``max(0, p - W + 1)
    .. p``; the block-table entries before the window start of a sequence's first new token
    are never read, and may hold anything. None: the whole context.
    ``logit_softcap`` c: each logit ``scale * q . k`` becomes ``c * tanh(logit / c)`` (in
    float32, before the mask). ``sinks``: head h's logit ``sinks[h]`` joins its softmax's
    denominator, ``p_j = exp(l_j) / (exp(sinks[h]) + sum_i exp(l_i))``.
    ``kv_scales``: given exactly when the cache stores float8_e4m3fn or int8 elements (the
    query then being float32, float16 or bfloat16); row 0 holds each KV head's K scale, row 1
    its V scale, and an element stands for ``element * scale``.
    Raises ValueError naming the argument when shapes, dtypes, devices, strides or the
    offsets disagree. The offsets' values are checked only on CPU (the interpreter): on a GPU
    reading them back would sync every call, so there they are the caller's contract.
    ``tiling``: for benchmarks that compare tilings; the default is the engine's.
    """
    _check_tensors(query, kv_cache_layer, query_start_loc, seq_lens, block_tables)
    require_prefill_offsets(
        query, kv_cache_layer, query_start_loc, seq_lens, block_tables, max_query_len
    )
    _check_tiling(tiling)
    require(
        sliding_window is None or sliding_window >= 1,
        f"sliding_window must be >= 1 or None, got {sliding_window}",
    )
    require_softcap(logit_softcap)
    require_sinks(sinks, query)
    require_kv_scales(kv_scales, kv_cache_layer)
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, tiling.block_m // group_pad)  # new tokens per program
    block_n = tiling.block_n if query.element_size() <= 2 else max(16, tiling.block_n // 2)
    num_warps = tiling.num_warps or (8 if block_q * group_pad * head_dim >= 128 * 128 else 4)
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query,
        kv_cache_layer,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        kv_cache_layer.stride(2),
        kv_cache_layer.stride(3),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        sliding_window or 0,
        (logit_softcap or 0.0) * LOG2_E,
        query if sinks is None else sinks,  # (not read without sinks)
        query if kv_scales is None else kv_scales,  # (not read unless quantized)
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=block_size,
        WINDOWED=sliding_window is not None,
        SOFTCAP=logit_softcap is not None,
        SINKS=sinks is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # the interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584)
        UPCAST_DOT=interpreted() and query.dtype == torch.bfloat16,
        KV_QUANTIZED=kv_scales is not None,
        num_warps=num_warps,
        num_stages=tiling.num_stages,
    )
    return out


def _check_tiling(tiling: PrefillTiling) -> None:
    require_power_of_two("tiling.block_m", tiling.block_m, 16)
    require_power_of_two("tiling.block_n", tiling.block_n, 16)
    if tiling.num_warps is not None:
        require_power_of_two("tiling.num_warps", tiling.num_warps, 1)
    require(tiling.num_stages >= 1, f"tiling.num_stages must be >= 1, got {tiling.num_stages}")


def _check_tensors(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Ranks, dtypes, devices and strides of the arguments."""
    require(
        query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {_shape(query)}"
    )
    require_kv_cache_layer(kv_cache_layer)
    _, num_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = kv_cache_layer.shape[3], kv_cache_layer.shape[4]
    require(
        cache_head_dim == head_dim,
        f"kv_cache_layer head_dim {cache_head_dim} differs from query's {head_dim}",
    )
    require(head_dim >= 1, f"query head_dim must be >= 1, got {head_dim}")
    require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"query num_heads {num_heads} is not a multiple of kv_cache_layer's {num_kv_heads}",
    )
    require(
        query.dtype in FLOAT_DTYPES, f"query dtype must be one of {FLOAT_DTYPES}, got {query.dtype}"
    )
    require(
        kv_cache_layer.dtype == query.dtype or is_quantized_cache(kv_cache_layer),
        f"kv_cache_layer dtype {kv_cache_layer.dtype} differs from query's {query.dtype}",
    )
    require(query.stride(2) == 1, f"query's last dim must be contiguous, strides {query.stride()}")
    require_prefill_index_tensors(
        query, kv_cache_layer, query_start_loc, seq_lens, block_tables, "kv_cache_layer"
    )


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM], strides (stride_q_tok, stride_q_head, 1)
    kv_ptr,  # [2, num_blocks, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    block_tables_ptr,  # [num_seqs, max_blocks]
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_q_tok,
    stride_q_head,
    stride_kv_side,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    window,  # the token at position p sees p - window + 1 .. p (read only when WINDOWED)
    softcap_log2,  # the logit soft-cap c * log2(e) (read only when SOFTCAP)
    sinks_ptr,  # [num_heads] f32: each head's sink logit (read only when SINKS)
    kv_scales_ptr,  # [2, num_kv_heads] f32: each head's K, then V scale (read if KV_QUANTIZED)
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_N: tl.constexpr,  # KV positions per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of two >= max(HEAD_DIM, 16); the extra dims are masked
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    WINDOWED: tl.constexpr,  # a sliding window of ``window`` tokens
    SOFTCAP: tl.constexpr,  # logits become c * tanh(logit / c)
    SINKS: tl.constexpr,  # a sink logit per head joins the softmax's denominator
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # run the dots in float32 (the interpreter's bfloat16 dot is wrong)
    KV_QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8 elements
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # last tiles (most work) first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len  # context cached before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] index among the seq's new tokens
    head_in_group = rows % GROUP_PAD
    row_valid = (token < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_rows = (q_start + token) * stride_q_tok + head * stride_q_head  # [BLOCK_M] int64
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    if KV_QUANTIZED:  # q . (k * k_scale) = (q . k) * k_scale; the V scale scales the output
        num_kv_heads = tl.num_programs(2)
        qk_scale = qk_scale * tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + num_kv_heads + kv_head)
    query_pos = prefix_len + token  # [BLOCK_M] absolute position; rows past q_len see all

    # The walk: with a window, the tiles [window_start, full_window) reach below a later
    # token's window start and are masked per row; then KV positions < diag_start are visible
    # to every row; the last token sees < kv_end.
    first_pos = prefix_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(prefix_len + (q_tile + 1) * BLOCK_Q, seq_len)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_head

    if SINKS:  # the sink as one more position, seen first: max its logit, sum exp2(0)
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * _LOG2_E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base-2 logits)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if WINDOWED:
        window_start = tl.maximum(first_pos - window + 1, 0)  # the first token's
        last_window_start = tl.maximum(kv_end - window, 0)  # the last (valid) token's
        num_edge_tiles = tl.cdiv(last_window_start - window_start, BLOCK_N)
        full_window = window_start + num_edge_tiles * BLOCK_N
        for tile_start in range(window_start, full_window, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, acc, m_i, l_i, query_pos, tile_start, kv_end, table, kv_base, qk_scale,
                window, softcap_log2, stride_kv_side, stride_kv_block, stride_kv_slot,
                BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
                KV_QUANTIZED, True, True,
            )  # fmt: skip
        unmasked = tl.maximum(first_pos + 1 - full_window, 0) // BLOCK_N * BLOCK_N
        diag_start = full_window + unmasked
    else:
        full_window = 0
        diag_start = (first_pos + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(full_window, diag_start, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, acc, m_i, l_i, query_pos, tile_start, kv_end, table, kv_base, qk_scale,
            window, softcap_log2, stride_kv_side, stride_kv_block, stride_kv_slot,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
            KV_QUANTIZED, False, False,
        )  # fmt: skip
    for tile_start in range(diag_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, acc, m_i, l_i, query_pos, tile_start, kv_end, table, kv_base, qk_scale,
            window, softcap_log2, stride_kv_side, stride_kv_block, stride_kv_slot,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
            KV_QUANTIZED, True, False,
        )  # fmt: skip

    if WINDOWED:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # 0 only in rows past q_len, whose windows may be empty
    if KV_QUANTIZED:
        acc = acc * v_scale
    acc = acc / l_i[:, None]
    out_rows = (q_start + token) * stride_o_tok + head * stride_o_head
    out_ptrs = out_ptr + out_rows[:, None] + dims[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    acc,  # [BLOCK_M, HEAD_DIM_PAD] float32
    m_i,  # [BLOCK_M] float32
    l_i,  # [BLOCK_M] float32
    query_pos,  # [BLOCK_M]
    tile_start,
    kv_end,
    table,  # this seq's block-table row
    kv_base,  # the cache's K at this kv head
    qk_scale,
    window,  # read only when WINDOW_MASK
    softcap_log2,  # read only when SOFTCAP
    stride_kv_side,
    stride_kv_block,
    stride_kv_slot,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_QUANTIZED: tl.constexpr,  # k, v are float8e4nv or int8 elements
    CAUSAL_MASK: tl.constexpr,  # the tile crosses the diagonal: mask positions > query_pos
    # (with CAUSAL_MASK) the tile reaches below a row's window: mask positions <= query_pos - window
    WINDOW_MASK: tl.constexpr,
):
    """One KV tile's online-softmax update of the rows' running max, denominator and output."""
    pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute context positions
    pos_valid = pos < kv_end
    block = tl.load(table + pos // PAGE_SIZE, mask=pos_valid, other=0).to(tl.int64)
    slot = block * stride_kv_block + (pos % PAGE_SIZE) * stride_kv_slot  # [BLOCK_N] int64
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    k_mask = pos_valid[None, :] & dim_valid[:, None]
    k = tl.load(kv_base + slot[None, :] + dims[:, None], mask=k_mask, other=0.0)
    v_ptrs = kv_base + stride_kv_side + slot[:, None] + dims[None, :]
    v = tl.load(v_ptrs, mask=pos_valid[:, None] & dim_valid[None, :], other=0.0)
    if KV_QUANTIZED:  # the stored elements, exactly, in the dot's type
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    elif UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:  # c * tanh(logit / c), in log2 units; tanh(x) = sign(x) (1 - e) / (1 + e)
        e = tl.exp2(tl.abs(scores) * (-2.0 * _LOG2_E) / softcap_log2)  # exp(-2 |logit / c|)
        tanh = (1.0 - e) / (1.0 + e)
        scores = tl.where(scores < 0, -tanh, tanh) * softcap_log2
    if CAUSAL_MASK:
        visible = (pos[None, :] <= query_pos[:, None]) & pos_valid[None, :]
        if WINDOW_MASK:
            visible = visible & (pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if WINDOW_MASK:
        # a row whose window starts past this tile has seen nothing yet: no NaN from it
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
    else:
        # every row sees the walk's first position (or, windowed, a position of an earlier
        # tile: the one of its window start), so m_new is finite from then on
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
