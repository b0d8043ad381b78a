"""The Triton attention kernels alone at a model's shapes, under each of a few tilings.

The compiled kernels' register counts (tests/engine/sm90_compile.py) say the default tilings
run at 255 registers per thread with some spilled; only timing on the GPU says which tiling is
fastest, so this section times each candidate once per run and marks the engine's default:
- decode (``paged_decode_attention``), one layer at each decode batch size with the preset's
  context, as KV bytes read per second beside the device copy's read bandwidth;
- prefill (``paged_prefill_attention``), one layer of one prompt of each prefill length, as
  causal attention FLOP/s beside the matmul peak;
- verify (speculative decoding): one layer of each batch with a token and 4 drafts per
  sequence, the ways it can run: the decode kernel with a sequence's rows folded into one
  program (what a decode graph replays), each row alone, and the prefill kernel (what an eager
  step runs); beside a plain decode of one row per sequence, whose KV bytes they all read.
Off CUDA it runs only under ``TRITON_INTERPRET=1`` (a smoke run).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from functools import partial
from typing import Any

import torch

from bench.gpu.shapes import BLOCK_SIZE, DTYPE_BYTES, ModelSpec
from bench.gpu.timing import log, time_op
from engine.kernels.paged_decode_attention import DecodeTiling, paged_decode_attention
from engine.kernels.paged_prefill_attention import PrefillTiling, paged_prefill_attention

DECODE_TILINGS = (
    DecodeTiling(),  # the engine's
    DecodeTiling(num_warps=8),
    DecodeTiling(max_tile=32),
    DecodeTiling(max_tile=32, num_warps=8),
    DecodeTiling(max_tile=16, num_warps=2),
)
VERIFY_ROWS_PER_SEQ = 5  # a token and 4 drafts
PREFILL_TILINGS = (
    PrefillTiling(),  # the engine's
    PrefillTiling(num_warps=4),
    PrefillTiling(block_m=64, num_warps=4),
    PrefillTiling(block_m=64, num_warps=8),
    PrefillTiling(block_n=32, num_warps=8),
    PrefillTiling(block_n=128, num_warps=8),
    PrefillTiling(num_stages=3),
)


def _paged_layer(
    spec: ModelSpec, num_seqs: int, seq_len: int, device: torch.device, dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache holding ``num_seqs`` contexts of ``seq_len`` in shuffled blocks, and
    their block tables ``[num_seqs, blocks per seq]``."""
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, device=device
    ).to(getattr(torch, dtype))
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    return cache, tables.to(torch.int32)


def _kv_bytes(spec: ModelSpec, num_seqs: int, context_len: int, dtype: str) -> int:
    """One layer's K and V of ``num_seqs`` contexts of ``context_len`` tokens."""
    return num_seqs * context_len * 2 * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[dtype]


def measure_decode_tilings(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    batch_sizes: list[int],
    context_len: int,
    reps: int,
    read_bw: float,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch_size in batch_sizes:
        cache, tables = _paged_layer(spec, batch_size, context_len, device, dtype)
        query = torch.randn(batch_size, spec.num_heads, spec.head_dim, device=device).to(
            cache.dtype
        )
        seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
        kv_bytes = _kv_bytes(spec, batch_size, context_len, dtype)
        for tiling in DECODE_TILINGS:
            call = partial(
                paged_decode_attention, query, cache, tables, seq_lens, spec.head_dim**-0.5,
                max_seq_len=context_len, tiling=tiling,
            )  # fmt: skip
            seconds = statistics.median(time_op(call, device, reps))
            rows.append(
                {
                    "batch_size": batch_size,
                    "context_len": context_len,
                    "tiling": asdict(tiling),
                    "default": tiling == DecodeTiling(),
                    "us": seconds * 1e6,
                    "gb_per_s": kv_bytes / seconds / 1e9,
                    "fraction_of_copy": kv_bytes / seconds / read_bw,
                }
            )
        best = min((r for r in rows if r["batch_size"] == batch_size), key=lambda r: r["us"])
        log(f"{spec.name}: decode attention, batch {batch_size}: best {best['tiling']}")
    return rows


def measure_prefill_tilings(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    prefill_lens: tuple[int, ...],
    reps: int,
    peak_flops: float,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for num_tokens in prefill_lens:
        cache, tables = _paged_layer(spec, 1, num_tokens, device, dtype)
        query = torch.randn(num_tokens, spec.num_heads, spec.head_dim, device=device).to(
            cache.dtype
        )
        starts = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
        # QK^T and PV over the causal triangle, every head (as ModelSpec.prefill_flops)
        flops = 2 * spec.num_heads * spec.head_dim * num_tokens * (num_tokens + 1)
        for tiling in PREFILL_TILINGS:
            call = partial(
                paged_prefill_attention, query, cache, starts, seq_lens, tables,
                spec.head_dim**-0.5, num_tokens, tiling,
            )  # fmt: skip
            seconds = statistics.median(time_op(call, device, reps))
            rows.append(
                {
                    "tokens": num_tokens,
                    "tiling": asdict(tiling),
                    "default": tiling == PrefillTiling(),
                    "us": seconds * 1e6,
                    "flop_per_s": flops / seconds,
                    "fraction_of_peak": flops / seconds / peak_flops,
                }
            )
        best = min((r for r in rows if r["tokens"] == num_tokens), key=lambda r: r["us"])
        log(f"{spec.name}: prefill attention, {num_tokens} tokens: best {best['tiling']}")
    return rows


def measure_verify_attention(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    batch_sizes: list[int],
    context_len: int,
    reps: int,
    read_bw: float,
) -> list[dict[str, Any]]:
    """Each batch's verify step (VERIFY_ROWS_PER_SEQ rows per sequence, its context ending at
    ``context_len``) per way of running it, and the plain decode step of the same sequences."""
    rows: list[dict[str, Any]] = []
    per_seq = VERIFY_ROWS_PER_SEQ
    scale = spec.head_dim**-0.5
    for batch_size in batch_sizes:
        cache, tables = _paged_layer(spec, batch_size, context_len, device, dtype)
        num_rows = batch_size * per_seq
        query = torch.randn(num_rows, spec.num_heads, spec.head_dim, device=device).to(cache.dtype)
        # row j of a sequence sees context_len - per_seq + 1 + j tokens
        row_lens = torch.arange(context_len - per_seq + 1, context_len + 1, device=device)
        row_lens = row_lens.repeat(batch_size).to(torch.int32)
        row_tables = tables.repeat_interleave(per_seq, dim=0)
        row_starts = torch.arange(0, num_rows + 1, per_seq, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
        ways = {
            "decode, one row per sequence": partial(
                paged_decode_attention, query[::per_seq], cache, tables, seq_lens, scale,
                max_seq_len=context_len,
            ),
            "verify, rows folded (graph)": partial(
                paged_decode_attention, query, cache, row_tables, row_lens, scale,
                max_seq_len=context_len, row_starts=row_starts, max_rows_per_seq=per_seq,
            ),
            "verify, each row alone": partial(
                paged_decode_attention, query, cache, row_tables, row_lens, scale,
                max_seq_len=context_len,
            ),
            "verify, prefill kernel (eager)": partial(
                paged_prefill_attention, query, cache, row_starts, seq_lens, tables, scale,
                per_seq,
            ),
        }  # fmt: skip
        kv_bytes = _kv_bytes(spec, batch_size, context_len, dtype)
        for way, call in ways.items():
            seconds = statistics.median(time_op(call, device, reps))
            rows.append(
                {
                    "batch_size": batch_size,
                    "context_len": context_len,
                    "rows_per_seq": per_seq,
                    "way": way,
                    "us": seconds * 1e6,
                    "gb_per_s": kv_bytes / seconds / 1e9,  # the sequences' KV, read once
                    "fraction_of_copy": kv_bytes / seconds / read_bw,
                }
            )
        log(f"{spec.name}: verify attention, batch {batch_size}: measured")
    return rows
