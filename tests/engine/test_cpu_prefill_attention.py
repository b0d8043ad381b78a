"""The C prefill-attention kernel (engine/kernels/cpu) against a float64 causal softmax over
each sequence's gathered context (cached prefix + new tokens, or each token's sliding window
of it), and with soft-capped logits or attention sinks against the torch reference; on float8
e4m3 and int8 caches against a float64 softmax over what they store and against the torch
reference; and its argument checks.
Greedy parity of the whole model on the CPU backend, which this kernel now serves for every
prefill, is tests/engine/test_parity.py's."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.cpu.paged_prefill_attention import paged_prefill_attention_cpu
from tests.engine.paged_tables import scattered_block_tables
from tests.engine.quantized_caches import QUANTIZED, stored_as

FLOAT32 = {"atol": 2e-5, "rtol": 2e-5}  # float32 results against a float64 reference


def _case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, cache, block tables (each seq's blocks a random pick, rows padded wider than
    needed), query_start_loc and seq_lens; nothing is zero."""
    generator = torch.Generator().manual_seed(sum(seq_lens) * 7 + block_size + head_dim)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    tables = scattered_block_tables(seq_lens, block_size, num_blocks, generator)
    starts = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0)
    return query, cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int64)


def _expected(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    num_heads, num_kv_heads, block_size = query.shape[1], cache.shape[3], cache.shape[2]
    outputs = []
    for row, seq_len in enumerate(seq_lens.tolist()):
        rows = query[starts[row] : starts[row + 1]].double()  # [query_len, heads, dim]
        positions = torch.arange(seq_len)
        blocks = tables[row, positions // block_size]
        key = cache[0, blocks, positions % block_size].double()  # [seq_len, kv_heads, dim]
        value = cache[1, blocks, positions % block_size].double()
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", rows, key) * query.shape[2] ** -0.5
        query_positions = torch.arange(seq_len - rows.shape[0], seq_len)
        hidden = positions[None, :] > query_positions[:, None]  # [query_len, seq_len]
        if sliding_window is not None:  # a token at p sees positions from p - W + 1 on
            hidden |= positions[None, :] <= query_positions[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value))
    return torch.cat(outputs)


def _run(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    **kwargs: int,
) -> None:
    case = _case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = paged_prefill_attention_cpu(*case, head_dim**-0.5, **kwargs)
    torch.testing.assert_close(out.double(), _expected(*case), **FLOAT32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_whole_prompts_match_a_float64_causal_softmax(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    rng = random.Random(num_heads * 1000 + block_size * 10 + head_dim)
    # one-token prompts, exact multiples of the block size, and ragged lengths past the tiles
    lens = [1, 2, block_size, 3 * block_size, *(rng.randint(2, 150) for _ in range(4))]
    _run(lens, lens, num_heads, num_kv_heads, head_dim, block_size)


@pytest.mark.parametrize("block_size", [4, 16])
def test_new_tokens_after_a_cached_prefix_see_the_prefix(block_size: int) -> None:
    """A prefix-cache hit or a later chunk of a chunked prefill: the new tokens sit at the
    end of a longer context, mixed in one call with whole prompts."""
    query_lens = [1, 7, 64, 100, 33, 5]
    seq_lens = [9, 7, 200, 100, 97, 260]
    _run(query_lens, seq_lens, 8, 2, 64, block_size)


def _windows(block_size: int) -> list[int]:
    """One position, less than a block, a span across block boundaries, one across KV tiles
    (32 positions), more than any context."""
    return [1, block_size // 2 + 1, 2 * block_size + 3, 45, 10_000]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_a_sliding_window_sees_each_tokens_last_positions_only(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    """Whole prompts and new tokens after a cached prefix, some past one tile of new tokens
    (64), whose rows then start their windows at different positions."""
    rng = random.Random(num_heads * 1000 + block_size * 10 + head_dim)
    query_lens = [1, 2, block_size, 3 * block_size, 70, *(rng.randint(2, 150) for _ in range(2))]
    seq_lens = [n + rng.choice([0, rng.randint(1, 120)]) for n in query_lens]
    case = _case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    whole = paged_prefill_attention_cpu(*case, scale)
    for window in _windows(block_size):
        out = paged_prefill_attention_cpu(*case, scale, sliding_window=window)
        torch.testing.assert_close(out.double(), _expected(*case, window), **FLOAT32)
    assert torch.equal(out, whole)  # the last window is longer than every context


@pytest.mark.parametrize("stale_block_id", [-1, 2**62])
def test_blocks_wholly_before_the_first_window_are_neither_read_nor_checked(
    stale_block_id: int,
) -> None:
    """The engine may free the blocks no new token can see, so their entries may hold
    anything; the block the first new token's window starts in is still checked."""
    block_size, window = 4, 20
    query_lens = [1, 7, 64, 100, 33, 5]
    seq_lens = [9, 7, 200, 100, 97, 260]
    case = _case(query_lens, seq_lens, 8, 2, 64, block_size)
    query, cache, tables, starts, lens = case
    fresh = paged_prefill_attention_cpu(*case, 0.125, sliding_window=window)
    stale = tables.clone()
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        stale[row, : max(0, seq_len - query_len - window + 1) // block_size] = stale_block_id
    assert int((stale == stale_block_id).sum()) == 0 + 0 + 29 + 0 + 11 + 59
    out = paged_prefill_attention_cpu(
        query, cache, stale, starts, lens, 0.125, sliding_window=window
    )
    assert torch.equal(out, fresh)
    torch.testing.assert_close(out.double(), _expected(*case, window), **FLOAT32)
    with pytest.raises(ValueError, match=r"sequence 2: .*entries in \[0, "):
        paged_prefill_attention_cpu(query, cache, stale, starts, lens, 0.125)  # all are read
    stale[2, (200 - 64 - window + 1) // block_size] = stale_block_id  # where the window starts
    with pytest.raises(ValueError, match="sequence 2: .* from the first block its window reaches"):
        paged_prefill_attention_cpu(query, cache, stale, starts, lens, 0.125, sliding_window=window)


@pytest.mark.parametrize("num_threads", [2, 3, 4])
def test_threads_change_no_bit_under_a_sliding_window(num_threads: int) -> None:
    rng = random.Random(num_threads)
    query_lens = [rng.randint(1, 150) for _ in range(6)]
    seq_lens = [n + rng.randint(0, 90) for n in query_lens]
    case = _case(query_lens, seq_lens, 8, 2, 64, 16)
    for window in (1, 9, 40, 257):
        alone = paged_prefill_attention_cpu(*case, 0.125, 1, sliding_window=window)
        shared = paged_prefill_attention_cpu(*case, 0.125, num_threads, sliding_window=window)
        assert torch.equal(alone, shared)


@pytest.mark.parametrize("sliding_window", [0, -1, -4096])
def test_a_window_under_one_position_is_refused_by_name(sliding_window: int) -> None:
    case = _case([20, 9], [20, 30], 4, 2, 64, 8)
    with pytest.raises(
        ValueError, match=f"sliding_window must be None or >= 1, got {sliding_window}"
    ):
        paged_prefill_attention_cpu(*case, 0.1, sliding_window=sliding_window)


@pytest.mark.parametrize("num_threads", [2, 3, 8])
def test_threads_share_the_work_and_change_no_bit(num_threads: int) -> None:
    rng = random.Random(num_threads)
    query_lens = [rng.randint(1, 150) for _ in range(6)]
    seq_lens = [n + rng.randint(0, 90) for n in query_lens]
    case = _case(query_lens, seq_lens, 8, 2, 64, 16)
    alone = paged_prefill_attention_cpu(*case, 0.125, num_threads=1)
    shared = paged_prefill_attention_cpu(*case, 0.125, num_threads=num_threads)
    assert torch.equal(alone, shared)
    torch.testing.assert_close(shared.double(), _expected(*case), **FLOAT32)


def test_large_scores_stay_finite() -> None:
    """Scores far beyond exp's range: the running max keeps the softmax exact."""
    query, cache, tables, starts, lens = _case([40, 70], [40, 90], 4, 2, 64, 16)
    query *= 60.0
    out = paged_prefill_attention_cpu(query, cache, tables, starts, lens, 64**-0.5)
    assert torch.isfinite(out).all()
    expected = _expected(query, cache, tables, starts, lens)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_no_sequences_is_an_empty_result() -> None:
    query, cache, tables, starts, lens = _case([3], [3], 4, 4, 64, 4)
    out = paged_prefill_attention_cpu(query[:0], cache, tables[:0], starts[:1], lens[:0], 0.1)
    assert out.shape == (0, 4, 64)


def test_bad_arguments_are_refused_by_name() -> None:
    query, cache, tables, starts, lens = _case([20, 9], [20, 30], 4, 2, 64, 8)
    out_of_range = tables.clone()
    out_of_range[1, 1] = cache.shape[1]  # one past the last block, inside seq 1's length
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 8 + 1
    fewer_positions = lens.clone()
    fewer_positions[1] = 8  # 9 new tokens cannot sit in 8 positions
    three_tables = torch.cat([tables, tables[:1]])  # for three sequences, one with no new token
    cases = [
        ((query, cache, out_of_range, starts, lens), r"sequence 1: .*entries in \[0, "),
        ((query, cache, tables, starts, too_long), r"sequence 0: .*<= 48 \(block_tables"),
        ((query, cache, tables, starts, fewer_positions), r"sequence 1: its 9 new tokens"),
        (
            (query, cache, three_tables, torch.tensor([0, 20, 20, 29]), torch.tensor([20, 5, 30])),
            r"sequence 1: its 0 new tokens",
        ),
        ((query.double(), cache, tables, starts, lens), "query must be float32"),
        ((query, cache.half(), tables, starts, lens), "kv_cache_layer must be float32"),
        ((query, cache, tables.int(), starts, lens), "block_tables must be int64"),
        ((query, cache, tables, starts.int(), lens), "query_start_loc must be int64"),
        ((query, cache, tables, starts[:2], lens), r"query_start_loc must be a contiguous \[3\]"),
        ((query, cache, tables, starts - 1, lens), "query_start_loc must run from 0 to query's 29"),
        ((query[:, :3].contiguous(), cache, tables, starts, lens), "multiple of the cache's 2"),
        ((query[:, :, :32].contiguous(), cache, tables, starts, lens), "head_dim 32 != "),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention_cpu(*args, 0.1)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        paged_prefill_attention_cpu(query, cache, tables, starts, lens, 0.1, num_threads=0)


# ---- soft-capped logits (Gemma 2) and attention sinks (gpt-oss) ----------------------------
# (logit soft-cap, with sinks): a cap of 2 bends the logits of a scale of 0.5 (std >= 4) hard
EXTRAS = {"softcap": (2.0, False), "sinks": (None, True), "both": (2.0, True)}


def _torch_reference(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens = query.shape[0]
    metadata = AttentionMetadata(
        num_prefill_seqs=seq_lens.shape[0],
        num_prefill_tokens=num_tokens,
        num_decode_seqs=0,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),  # unused by forward
        prefill_query_start_loc=starts.tolist(),
        prefill_seq_lens=seq_lens.tolist(),
        prefill_block_tables=tables,
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        max_decode_seq_len=0,
    )
    return TorchAttentionBackend().forward(
        query,
        cache,
        metadata,
        scale,
        sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
        kv_scales=kv_scales,
    )


@pytest.mark.parametrize("sliding_window", [None, 21], ids=["whole", "window-21"])
@pytest.mark.parametrize("extras", EXTRAS, ids=list(EXTRAS))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 128), (6, 2, 48)]
)
def test_softcap_and_sinks_match_the_torch_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, extras: str, sliding_window: int | None
) -> None:
    """Whole prompts and new tokens after a cached prefix, one past a tile of new tokens (64),
    in blocks of 5; on one thread and three, to the bit."""
    softcap, with_sinks = EXTRAS[extras]
    query_lens = [1, 7, 70, 33, 2]
    seq_lens = [1, 50, 70, 100, 9]
    case = _case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 5)
    generator = torch.Generator().manual_seed(num_heads)
    sinks = 2 * torch.randn(num_heads, generator=generator) + 1 if with_sinks else None
    out = paged_prefill_attention_cpu(*case, 0.5, 1, sliding_window, softcap, sinks)
    shared = paged_prefill_attention_cpu(*case, 0.5, 3, sliding_window, softcap, sinks)
    assert torch.equal(out, shared)
    expected = _torch_reference(*case, 0.5, sliding_window, softcap, sinks)
    torch.testing.assert_close(out, expected, **FLOAT32)


def test_bad_softcap_and_sinks_are_refused_by_name() -> None:
    case = _case([20, 9], [20, 30], 4, 2, 64, 8)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"logit_softcap": 0.0}, "logit_softcap must be > 0 and finite, or None, got 0.0"),
        ({"logit_softcap": float("inf")}, "logit_softcap must be > 0 and finite"),
        ({"sinks": torch.zeros(2)}, r"sinks must be a contiguous \[num_heads = 4\], got \(2,\)"),
        ({"sinks": torch.zeros(4).double()}, "sinks must be float32, got torch.float64"),
        ({"sinks": torch.zeros(4, device="meta")}, "sinks is on meta"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention_cpu(*case, 0.1, **kwargs)


# ---- quantized caches: float8 e4m3 and int8 elements, a K and a V scale per KV head ---------


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_quantized_cache_matches_a_float64_causal_softmax_of_what_it_stores(
    kv_cache_dtype: str, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    """Whole prompts and new tokens after a cached prefix (some past one tile of new tokens),
    whole contexts and sliding windows: the scales folded into the queries and the output keep
    float32's tolerance against a float64 softmax over the dequantized cache; head_dim 40
    leaves a part-vector after the 16-element reads."""
    rng = random.Random(num_heads * 1000 + block_size * 10 + head_dim)
    query_lens = [1, 2, block_size, 70, *(rng.randint(2, 150) for _ in range(2))]
    seq_lens = [n + rng.choice([0, rng.randint(1, 120)]) for n in query_lens]
    query, cache, tables, starts, lens = _case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size
    )
    stored, kv_scales, dequantized = stored_as(cache, kv_cache_dtype, head_dim)
    scale = head_dim**-0.5
    for window in (None, 1, 2 * block_size + 3, 45):
        out = paged_prefill_attention_cpu(
            query, stored, tables, starts, lens, scale, sliding_window=window, kv_scales=kv_scales
        )
        expected = _expected(query, dequantized, tables, starts, lens, window)
        torch.testing.assert_close(out.double(), expected, **FLOAT32)


@pytest.mark.parametrize("sliding_window", [None, 21], ids=["whole", "window-21"])
@pytest.mark.parametrize("extras", EXTRAS, ids=list(EXTRAS))
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_quantized_cache_with_softcap_and_sinks_matches_the_torch_reference(
    kv_cache_dtype: str, extras: str, sliding_window: int | None
) -> None:
    """GQA (8 heads over 2), whole prompts and new tokens after a cached prefix in blocks of 5,
    against the torch reference reading the same quantized cache; on one thread and three, to
    the bit."""
    softcap, with_sinks = EXTRAS[extras]
    case = _case([1, 7, 70, 33, 2], [1, 50, 70, 100, 9], 8, 2, 64, 5)
    query, cache, tables, starts, lens = case
    stored, kv_scales, _ = stored_as(cache, kv_cache_dtype, 7)
    generator = torch.Generator().manual_seed(8)
    sinks = 2 * torch.randn(8, generator=generator) + 1 if with_sinks else None
    quantized_case = (query, stored, tables, starts, lens, 0.5)
    out = paged_prefill_attention_cpu(*quantized_case, 1, sliding_window, softcap, sinks, kv_scales)
    shared = paged_prefill_attention_cpu(
        *quantized_case, 3, sliding_window, softcap, sinks, kv_scales
    )
    assert torch.equal(out, shared)
    expected = _torch_reference(*quantized_case, sliding_window, softcap, sinks, kv_scales)
    torch.testing.assert_close(out, expected, **FLOAT32)


def test_bad_kv_scales_are_refused_by_name() -> None:
    query, cache, tables, starts, lens = _case([20, 9], [20, 30], 4, 2, 64, 8)
    stored, kv_scales, _ = stored_as(cache, "fp8_e4m3", 0)
    cases: list[tuple[torch.Tensor, torch.Tensor | None, str]] = [
        (stored, None, "a torch.float8_e4m3fn kv_cache_layer needs kv_scales"),
        (cache, kv_scales, "kv_scales are for a quantized cache; kv_cache_layer is torch.float32"),
        (stored, kv_scales.repeat(1, 2), r"kv_scales must be a contiguous \[2, num_kv_heads = 2\]"),
        (stored, kv_scales.half(), "kv_scales must be float32"),
    ]
    for kv_cache_layer, scales, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention_cpu(
                query, kv_cache_layer, tables, starts, lens, 0.1, kv_scales=scales
            )
