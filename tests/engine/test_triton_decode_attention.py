"""The Triton paged decode-attention kernels vs a gather-and-softmax reference and the torch
backend, on random inputs.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which is slow: shapes stay small.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.kv_cache_write import write_kv_cache
from engine.kernels.paged_decode_attention import (
    DecodeTiling,
    default_num_splits,
    default_tokens_per_split,
    paged_decode_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DecodeCase:
    """Random decode inputs: each seq's blocks are a random (non-sequential) pick of the cache."""

    query: torch.Tensor  # [num_seqs, num_heads, head_dim]
    kv_cache_layer: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64
    scale: float


def _make_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> DecodeCase:
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few never used
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(*cache_shape, generator=generator)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int64)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor(block_ids[:count])
        block_ids = block_ids[count:]
    return DecodeCase(
        query=query.to(dtype=dtype, device=DEVICE),
        kv_cache_layer=cache.to(dtype=dtype, device=DEVICE),
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
        scale=head_dim**-0.5,
    )


def _reference(
    case: DecodeCase, sliding_window: int | None = None
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] float32
    """Gather each seq's blocks, repeat K/V over the group, softmax attention in float64 over
    the context (its last ``sliding_window`` tokens with a window)."""
    _, _, block_size, num_kv_heads, head_dim = case.kv_cache_layer.shape
    group = case.query.shape[1] // num_kv_heads
    outputs = []
    for row, seq_len in enumerate(case.seq_lens.tolist()):
        blocks = case.block_tables[row, : -(-seq_len // block_size)]
        start = 0 if sliding_window is None else max(0, seq_len - sliding_window)
        # [seq_len - start, num_heads, head_dim]
        key = case.kv_cache_layer[0, blocks].flatten(0, 1)[start:seq_len].double()
        value = case.kv_cache_layer[1, blocks].flatten(0, 1)[start:seq_len].double()
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        logits = torch.einsum("hd,thd->ht", case.query[row].double(), key) * case.scale
        outputs.append(torch.einsum("ht,thd->hd", logits.softmax(-1), value))
    return torch.stack(outputs).float()


def _run(case: DecodeCase, num_splits: int | None = None) -> torch.Tensor:
    return paged_decode_attention(
        case.query, case.kv_cache_layer, case.block_tables, case.seq_lens, case.scale, num_splits
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "head_dim", "num_splits"),
    [
        (4, 4, 4, 64, None),  # MHA (group 1)
        (4, 2, 8, 64, 3),  # group 2
        (8, 2, 16, 128, 2),  # group 4
        (4, 1, 8, 64, 4),  # MQA (group 4, one KV head)
        (6, 2, 8, 48, 2),  # group 3 and head_dim 48: neither a power of two
        (16, 2, 16, 64, 2),  # group 8 (Llama-3-70B)
        (32, 1, 4, 64, 3),  # MQA of 32 heads: more padded rows than the 16 a dot needs
    ],
)
def test_matches_reference(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int, num_splits: int | None
) -> None:
    """Mixed lengths, none a multiple of the block size but one, shuffled block tables."""
    seq_lens = [1, 2 * block_size, 3 * block_size + 5, 37]
    case = _make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = _run(case, num_splits)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=1e-5)


def test_every_seq_of_length_one() -> None:
    case = _make_case([1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    torch.testing.assert_close(_run(case, 2), _reference(case), atol=2e-5, rtol=1e-5)
    # one token: the output is that token's V
    value = case.kv_cache_layer[1, case.block_tables[:, 0], 0]  # [num_seqs, num_kv_heads, hd]
    torch.testing.assert_close(_run(case), value.repeat_interleave(2, 1))


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_forced_splits_beyond_short_seqs(num_splits: int) -> None:
    """Partitions past a short seq's end are empty; the long seq spans several partitions
    (with 1 or 2, of several 64-token tiles each)."""
    case = _make_case([3, 150, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=1)
    torch.testing.assert_close(_run(case, num_splits), _reference(case), atol=2e-5, rtol=1e-5)


def test_tight_max_seq_len_and_int32_indices() -> None:
    case = _make_case([20, 7], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=2)
    wide_tables = torch.nn.functional.pad(case.block_tables, (0, 13))  # padded far past need
    out = paged_decode_attention(
        case.query,
        case.kv_cache_layer,
        wide_tables.to(torch.int32),
        case.seq_lens.to(torch.int32),
        case.scale,
        num_splits=3,
        max_seq_len=20,
    )
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=1e-5)


def test_strided_query() -> None:
    """The query as a view of a fused QKV projection: rows further apart than num_heads."""
    case = _make_case([11, 30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=3)
    fused = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    fused[:, :4] = case.query
    strided = DecodeCase(fused[:, :4], case.kv_cache_layer, case.block_tables, case.seq_lens, 0.1)
    assert not strided.query.is_contiguous()
    torch.testing.assert_close(_run(strided, 2), _reference(strided), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_splits", "head_dim"), [(1, 64), (3, 64), (2, 128)])
def test_half_precision(dtype: torch.dtype, num_splits: int, head_dim: int) -> None:
    seq_lens = [5, 40, 17]
    case = _make_case(
        seq_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=8, dtype=dtype
    )
    out = _run(case, num_splits)
    assert out.dtype == dtype
    # bf16 keeps 8 mantissa bits: the probabilities are rounded before the P @ V product
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), _reference(case), atol=tolerance, rtol=tolerance)


def test_write_then_decode_matches_torch_backend() -> None:
    """Both kernels end to end vs TorchAttentionBackend's write_kv + forward on decode metadata."""
    seq_lens = [6, 19, 1]
    case = _make_case(seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=5)
    generator = torch.Generator().manual_seed(6)
    new_kv = torch.randn(2, len(seq_lens), 2, 64, generator=generator).to(DEVICE)
    positions = case.seq_lens - 1  # the new token is each seq's last
    slots = case.block_tables.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    metadata = _decode_metadata(case, slots)
    backend = TorchAttentionBackend()
    torch_cache = case.kv_cache_layer.clone()
    backend.write_kv(torch_cache, new_kv[0], new_kv[1], slots)
    expected = backend.forward(case.query, torch_cache, metadata, case.scale)

    write_kv_cache(case.kv_cache_layer, new_kv[0], new_kv[1], slots)
    assert torch.equal(case.kv_cache_layer, torch_cache)
    out = paged_decode_attention(
        case.query,
        case.kv_cache_layer,
        metadata.decode_block_tables,
        metadata.decode_seq_lens,
        case.scale,
        num_splits=2,
        max_seq_len=metadata.max_decode_seq_len,
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def _decode_metadata(case: DecodeCase, slots: torch.Tensor | None = None) -> AttentionMetadata:
    """The case's rows as a step of decodes (``slots``: their new tokens', unused by forward)."""
    num_rows = case.seq_lens.shape[0]
    return AttentionMetadata(
        num_prefill_seqs=0,
        num_prefill_tokens=0,
        num_decode_seqs=num_rows,
        slot_mapping=torch.zeros(num_rows, dtype=torch.int64) if slots is None else slots,
        prefill_query_start_loc=[0],
        prefill_seq_lens=[],
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int64, device=DEVICE),
        decode_seq_lens=case.seq_lens,
        decode_block_tables=case.block_tables,
        max_decode_seq_len=int(case.seq_lens.max()),
    )


def test_default_num_splits() -> None:
    assert default_num_splits(max_seq_len=100, num_seqs=1, num_kv_heads=8) == 1  # short
    assert default_num_splits(max_seq_len=1024, num_seqs=64, num_kv_heads=8) == 1  # busy grid
    assert default_num_splits(max_seq_len=4096, num_seqs=2, num_kv_heads=8) == 16
    assert default_num_splits(max_seq_len=1 << 20, num_seqs=1, num_kv_heads=1) == 64  # capped


def test_default_tokens_per_split() -> None:
    """Whole tiles, as many as the longest context needs for ``default_num_splits``."""
    assert default_tokens_per_split(512, num_seqs=1, num_kv_heads=2) == 256  # two partitions
    assert default_tokens_per_split(4096, num_seqs=2, num_kv_heads=8) == 256  # sixteen
    assert default_tokens_per_split(1000, num_seqs=1, num_kv_heads=8) == 256  # 250 -> tiles
    assert default_tokens_per_split(1024, num_seqs=64, num_kv_heads=8) == 1024  # one
    assert default_tokens_per_split(100, num_seqs=1, num_kv_heads=1) == 128
    assert default_tokens_per_split(10, num_seqs=1, num_kv_heads=1) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_whatever_the_bound(dtype: torch.dtype) -> None:
    """A CUDA graph bounds the contexts by the static capacity, an eager step by its longest
    one: with the same partition size, each sequence's output is the same to the bit (one
    partition, several, a context ending on a partition's edge), only the grid differs."""
    seq_lens = [1, 31, 32, 33, 64, 70, 97]
    case = _make_case(seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype)
    args = (case.query, case.kv_cache_layer, case.block_tables, case.seq_lens, case.scale)
    capacity = case.block_tables.shape[1] * 4
    by_longest = paged_decode_attention(*args, max_seq_len=max(seq_lens), tokens_per_split=32)
    by_capacity = paged_decode_attention(*args, max_seq_len=capacity, tokens_per_split=32)
    assert torch.equal(by_longest, by_capacity)
    short = [0, 1, 2]  # one partition each: written by the first kernel without a merge
    alone = paged_decode_attention(
        case.query[short],
        case.kv_cache_layer,
        case.block_tables[short],
        case.seq_lens[short],
        case.scale,
        max_seq_len=32,
        tokens_per_split=32,
    )
    assert torch.equal(alone, by_capacity[short])
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(by_capacity.float(), _reference(case), atol=tolerance, rtol=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="checked on the host only (a GPU would sync)")
def test_seq_lens_outside_the_tables_are_refused_on_the_host() -> None:
    """On CPU the values are there to check: a context longer than its table row read the next
    row's blocks, one of 0 gave NaN, an understated bound dropped tokens, all silently."""
    case = _make_case([5, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    args = (case.query, case.kv_cache_layer, case.block_tables)
    with pytest.raises(ValueError, match="seq_lens must be <= max_seq_len = 16"):
        paged_decode_attention(*args, torch.tensor([5, 20], device=DEVICE), 0.1)
    with pytest.raises(ValueError, match="seq_lens must be >= 1, got 0"):
        paged_decode_attention(*args, torch.tensor([0, 9], device=DEVICE), 0.1)
    with pytest.raises(ValueError, match="seq_lens must be <= max_seq_len = 6"):
        paged_decode_attention(*args, case.seq_lens, 0.1, max_seq_len=6)
    with pytest.raises(ValueError, match="num_splits or tokens_per_split"):
        paged_decode_attention(*args, case.seq_lens, 0.1, 2, tokens_per_split=16)


def _bad_case(argument: str) -> tuple[list[object], str]:
    case = _make_case([5, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    args: list[object] = [case.query, case.kv_cache_layer, case.block_tables, case.seq_lens, 0.1]
    bad: dict[str, tuple[int, object, str]] = {
        "query_shape": (0, case.query[:, :, :32], "query must be"),
        "query_heads": (0, case.query[:, :3], "not a multiple of num_kv_heads"),
        "query_dtype": (0, case.query.double(), "query dtype"),
        "query_strides": (0, case.query.transpose(1, 2).contiguous().transpose(1, 2), "head_dim"),
        "cache_strides": (1, case.kv_cache_layer.transpose(1, 2), "kv_cache_layer must be contig"),
        "cache_dtype": (1, case.kv_cache_layer.to(torch.int32), "kv_cache_layer dtype"),
        "tables_shape": (2, case.block_tables[:1], "block_tables must be"),
        "tables_dtype": (2, case.block_tables.float(), "block_tables must be int32 or int64"),
        "tables_strides": (2, case.block_tables.t().contiguous().t(), "block_tables rows"),
        "lens_shape": (3, case.seq_lens[:, None], "seq_lens must be"),
        "lens_device": (3, torch.empty(2, dtype=torch.int64, device="meta"), "seq_lens is on"),
    }
    position, value, message = bad[argument]
    args[position] = value
    return args, message


@pytest.mark.parametrize(
    "argument",
    [
        "query_shape",
        "query_heads",
        "query_dtype",
        "query_strides",
        "cache_strides",
        "cache_dtype",
        "tables_shape",
        "tables_dtype",
        "tables_strides",
        "lens_shape",
        "lens_device",
    ],
)
def test_bad_arguments_name_the_argument(argument: str) -> None:
    args, message = _bad_case(argument)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(*args)  # type: ignore[arg-type]


def test_bad_split_settings() -> None:
    case = _make_case([5, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    args = (case.query, case.kv_cache_layer, case.block_tables, case.seq_lens, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_decode_attention(*args, max_seq_len=17)  # the tables hold 2 blocks of 8
    with pytest.raises(ValueError, match="tiling.max_tile must be a power of two >= 16"):
        paged_decode_attention(*args, tiling=DecodeTiling(max_tile=24))
    with pytest.raises(ValueError, match="tiling.num_warps"):
        paged_decode_attention(*args, tiling=DecodeTiling(num_warps=0))


def test_a_smaller_tiling_gives_the_same_attention() -> None:
    """The tilings bench.gpu compares: 16-token tiles walk a 150-token seq in ten."""
    case = _make_case([3, 150, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=1)
    args = (case.query, case.kv_cache_layer, case.block_tables, case.seq_lens, case.scale, 1)
    out = paged_decode_attention(*args, tiling=DecodeTiling(max_tile=16, num_warps=8))
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=1e-5)


# ---- a sequence's rows folded into one program (speculative decoding's verify rows) --------
def _verify_rows(
    case: DecodeCase, rows_per_seq: list[int], seed: int = 5
) -> tuple[DecodeCase, torch.Tensor]:
    """``case``'s sequences as ``rows_per_seq[i]`` rows each: the last ones of its context,
    each seeing one token more than the row before, all with the sequence's block table; and
    the row starts of the sequences (an entry of 0 rows gives an empty group)."""
    generator = torch.Generator().manual_seed(seed)
    lens, tables, starts = [], [], [0]
    for seq_len, table, num_rows in zip(
        case.seq_lens.tolist(), case.block_tables, rows_per_seq, strict=True
    ):
        lens.extend(range(seq_len - num_rows + 1, seq_len + 1))
        tables.extend([table] * num_rows)
        starts.append(starts[-1] + num_rows)
    _, num_heads, head_dim = case.query.shape
    query = torch.randn(len(lens), num_heads, head_dim, generator=generator)
    expanded = DecodeCase(
        query=query.to(dtype=case.query.dtype, device=DEVICE),
        kv_cache_layer=case.kv_cache_layer,
        block_tables=torch.stack(tables),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=DEVICE),
        scale=case.scale,
    )
    return expanded, torch.tensor(starts, dtype=torch.int32, device=DEVICE)


def _run_folded(
    case: DecodeCase, row_starts: torch.Tensor, max_rows: int, num_splits: int | None = None
) -> torch.Tensor:
    return paged_decode_attention(
        case.query,
        case.kv_cache_layer,
        case.block_tables,
        case.seq_lens,
        case.scale,
        num_splits,
        row_starts=row_starts,
        max_rows_per_seq=max_rows,
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "max_rows", "num_splits"),
    [
        (4, 4, 4, 5, None),  # group 1: 5 rows of a tile of 16
        (8, 2, 8, 4, 3),  # group 4 x 4 rows: exactly 16
        (6, 2, 8, 5, 2),  # group 3 x 5 rows = 15: a row's heads straddle no tile boundary
        (16, 2, 16, 3, 4),  # group 8 x 3 = 24 rows of a tile of 32
    ],
)
def test_folded_rows_match_each_row_alone(
    num_heads: int, num_kv_heads: int, block_size: int, max_rows: int, num_splits: int | None
) -> None:
    """Sequences of max_rows rows, of fewer, of one, and an empty group: each row's output is
    its own attention (and the kernel's without folding)."""
    base = _make_case([9, 70, 3 * block_size, 40], num_heads, num_kv_heads, 64, block_size)
    rows_per_seq = [max_rows, 2, 1, 0]
    case, starts = _verify_rows(base, rows_per_seq)
    folded = _run_folded(case, starts, max_rows, num_splits)
    assert folded.shape == case.query.shape
    torch.testing.assert_close(folded, _reference(case), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(folded, _run(case, num_splits), atol=2e-6, rtol=1e-6)


def test_folded_rows_whose_contexts_end_on_both_sides_of_a_partition() -> None:
    """Partitions of 16 tokens: rows of contexts 30..34 end in the second and third; the
    first rows' partitions past their own context are written empty and never merged."""
    base = _make_case([34, 17], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=6)
    case, starts = _verify_rows(base, [5, 3])
    out = paged_decode_attention(
        case.query,
        case.kv_cache_layer,
        case.block_tables,
        case.seq_lens,
        case.scale,
        tokens_per_split=16,
        row_starts=starts,
        max_rows_per_seq=5,
    )
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=1e-5)


def test_trailing_empty_groups_and_padding_rows() -> None:
    """A graph's layout: the sequences' groups, padding rows alone, then empty groups."""
    base = _make_case([12, 5, 1, 1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    case, _ = _verify_rows(base, [3, 2, 1, 1])
    starts = torch.tensor([0, 3, 5, 6, 7, 7, 7], dtype=torch.int32, device=DEVICE)
    out = _run_folded(case, starts, max_rows=3, num_splits=2)
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=1e-5)


def test_bad_row_starts_are_named() -> None:
    base = _make_case([12, 5], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    case, starts = _verify_rows(base, [3, 2])
    bad = [
        (starts.float(), 3, "row_starts must be int32 or int64"),
        (starts[1:], 3, "row_starts must rise from 0 to num_rows = 5"),
        (torch.tensor([0, 3, 2, 5], dtype=torch.int32), 3, "must rise from 0"),
        (starts, 2, "a group of row_starts has 3 rows > max_rows_per_seq = 2"),
        (torch.tensor([0, 2, 5], dtype=torch.int32), 3, r"must see one token more each"),
        (starts, 0, "max_rows_per_seq must be >= 1"),
    ]
    for row_starts, max_rows, message in bad:
        with pytest.raises(ValueError, match=message):
            _run_folded(case, row_starts.to(DEVICE), max_rows)


# ---- a sliding window: a row of context n sees its last W tokens, n - W .. n - 1 -----------
def _run_windowed(
    case: DecodeCase,
    sliding_window: int,
    tokens_per_split: int,
    row_starts: torch.Tensor | None = None,
    max_rows: int = 1,
    block_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_decode_attention(
        case.query,
        case.kv_cache_layer,
        case.block_tables if block_tables is None else block_tables,
        case.seq_lens,
        case.scale,
        tokens_per_split=tokens_per_split,
        row_starts=row_starts,
        max_rows_per_seq=max_rows,
        sliding_window=sliding_window,
    )


# one token, less than a block of 8, across blocks and partitions, more than every context
@pytest.mark.parametrize("sliding_window", [1, 5, 21, 100])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(2, 2, 64), (8, 2, 64), (6, 2, 48)],
    ids=["mha", "gqa4", "gqa3-head-dim-48"],
)
def test_sliding_window_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int
) -> None:
    """One partition, and partitions of 16 tokens: the 70-token context's partitions wholly
    before a short window are empty."""
    case = _make_case([1, 16, 37, 70], num_heads, num_kv_heads, head_dim, 8, seed=7)
    expected = _reference(case, sliding_window)
    for tokens_per_split in (80, 16):
        out = _run_windowed(case, sliding_window, tokens_per_split)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [2, 13, 40])
def test_sliding_window_over_folded_rows(sliding_window: int) -> None:
    """Each of a sequence's rows sees its own window, the first row's starting earliest;
    partitions of 16 tokens."""
    base = _make_case([9, 70, 40], num_heads=8, num_kv_heads=2, head_dim=64, block_size=4, seed=8)
    case, starts = _verify_rows(base, [3, 5, 1])
    out = _run_windowed(case, sliding_window, 16, row_starts=starts, max_rows=5)
    torch.testing.assert_close(out, _reference(case, sliding_window), atol=2e-5, rtol=1e-5)


def test_a_windowed_sequence_gets_the_same_bits_whatever_the_bound() -> None:
    """As without a window: a graph's bound (the capacity) and an eager step's (the longest
    context) give each row the same bits, its partitions before the window skipped by both."""
    case = _make_case([1, 20, 33, 70], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    wide_tables = torch.nn.functional.pad(case.block_tables, (0, 8))  # 104 tokens: 7 partitions
    args = (case.query, case.kv_cache_layer, wide_tables, case.seq_lens, case.scale)
    outputs = [
        paged_decode_attention(*args, max_seq_len=bound, tokens_per_split=16, sliding_window=20)
        for bound in (70, 104)
    ]
    assert torch.equal(*outputs)


@pytest.mark.parametrize("folded", [False, True], ids=["rows-alone", "folded"])
def test_blocks_before_the_window_are_never_read(folded: bool) -> None:
    """The engine may free the blocks wholly before a sequence's windows: their table entries
    as -1, or pointing at a block of NaN, leave every row's output as it was, to the bit."""
    window, block_size = 10, 4
    base = _make_case([45, 22, 9], 4, 2, 64, block_size, seed=9)
    rows, starts = _verify_rows(base, [4, 2, 1])
    nan_block = torch.full_like(rows.kv_cache_layer[:, :1], float("nan"))
    poisoned_cache = torch.cat([rows.kv_cache_layer, nan_block], dim=1)
    case = DecodeCase(rows.query, poisoned_cache, rows.block_tables, rows.seq_lens, rows.scale)
    freed = torch.zeros_like(case.block_tables, dtype=torch.bool)
    lens, bounds = case.seq_lens.tolist(), starts.tolist()
    for first, end in zip(bounds[:-1], bounds[1:]):
        # before the window of the sequence's first row (which a folded program starts from)
        freed[first:end, : max(0, lens[first] - window) // block_size] = True
    assert freed.sum(dim=1).tolist() == [8] * 4 + [2] * 2 + [0]  # blocks freed per row
    row_starts = starts if folded else None
    expected = _run_windowed(case, window, 16, row_starts, max_rows=4)
    torch.testing.assert_close(expected, _reference(case, window), atol=2e-5, rtol=1e-5)
    nan_block_id = poisoned_cache.shape[1] - 1
    for entry in (-1, nan_block_id):
        tables = case.block_tables.masked_fill(freed, entry)
        out = _run_windowed(case, window, 16, row_starts, max_rows=4, block_tables=tables)
        assert torch.equal(out, expected), entry


@pytest.mark.parametrize("sliding_window", [0, -3])
def test_a_window_below_one_token_is_refused(sliding_window: int) -> None:
    case = _make_case([5, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    with pytest.raises(
        ValueError, match=f"sliding_window must be >= 1 or None, got {sliding_window}"
    ):
        _run_windowed(case, sliding_window, 16)


# ---- soft-capped logits (Gemma 2) and attention sinks (gpt-oss) ----------------------------
# (logit soft-cap, with sinks): a cap of 2 bends the logits of a scale of 0.5 (std 4) hard
EXTRAS = {"softcap": (2.0, False), "sinks": (None, True), "both": (2.0, True)}


def _sinks(num_heads: int) -> torch.Tensor:  # [num_heads] f32: some far above the logits
    generator = torch.Generator().manual_seed(num_heads)
    return (2 * torch.randn(num_heads, generator=generator) + 1).to(DEVICE)


def _torch_reference(
    case: DecodeCase,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads]: the case's cache is quantized
) -> torch.Tensor:  # [num_rows, num_heads, head_dim] float32
    """The torch backend's explicit softmax over the case's rows, from float32 inputs (a
    quantized cache read as float32 by its scales)."""
    cache = case.kv_cache_layer if kv_scales is not None else case.kv_cache_layer.float()
    exact = replace(case, query=case.query.float(), kv_cache_layer=cache)
    return TorchAttentionBackend().forward(
        exact.query,
        exact.kv_cache_layer,
        _decode_metadata(exact),
        exact.scale,
        sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
        kv_scales=kv_scales,
    )


def _run_extras(
    case: DecodeCase,
    tokens_per_split: int,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,
    row_starts: torch.Tensor | None = None,
    max_rows: int = 1,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    return paged_decode_attention(
        case.query,
        case.kv_cache_layer,
        case.block_tables,
        case.seq_lens,
        case.scale,
        max_seq_len=max_seq_len,
        tokens_per_split=tokens_per_split,
        row_starts=row_starts,
        max_rows_per_seq=max_rows,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )


@pytest.mark.parametrize("sliding_window", [None, 21], ids=["whole", "window-21"])
@pytest.mark.parametrize("extras", EXTRAS, ids=list(EXTRAS))
def test_softcap_and_sinks_match_the_torch_reference(
    extras: str, sliding_window: int | None
) -> None:
    """Rows of 1 to 70 tokens in one partition, and in partitions of 16 (the 70-token row's
    window starts in its fourth of five): each row's sink is counted once."""
    softcap, with_sinks = EXTRAS[extras]
    case = replace(_make_case([1, 16, 37, 70], 8, 2, 64, 8, seed=10), scale=0.5)
    sinks = _sinks(8) if with_sinks else None
    expected = _torch_reference(case, sliding_window, softcap, sinks)
    for tokens_per_split in (80, 16):
        out = _run_extras(case, tokens_per_split, sliding_window, softcap, sinks)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_sinks_over_folded_rows_whose_windows_start_in_different_partitions() -> None:
    """A sequence's rows of contexts 60..64 under a window of 14 start seeing at 46..50: two
    rows in the third partition of 16 tokens, three in the fourth, where each counts its sink."""
    base = replace(_make_case([64, 40, 9], 8, 2, 64, 4, seed=11), scale=0.5)
    case, starts = _verify_rows(base, [5, 3, 1])
    sinks = _sinks(8)
    out = _run_extras(case, 16, 14, 2.0, sinks, row_starts=starts, max_rows=5)
    torch.testing.assert_close(out, _torch_reference(case, 14, 2.0, sinks), atol=2e-5, rtol=1e-5)


def test_softcap_and_sinks_in_bfloat16() -> None:
    case = replace(_make_case([1, 37, 70], 8, 2, 64, 8, torch.bfloat16, seed=12), scale=0.5)
    sinks = _sinks(8)
    out = _run_extras(case, 16, 21, 2.0, sinks)
    assert out.dtype == torch.bfloat16
    expected = _torch_reference(case, 21, 2.0, sinks)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_windowed_sequence_with_sinks_gets_the_same_bits_whatever_the_bound() -> None:
    """As without sinks: a row counts its sink in the same partition (the one its window
    starts in) whether the grid has one partition (no merge), as many as the longest context
    needs (3) or as many as the capacity holds (5)."""
    case = replace(_make_case([1, 31, 32, 33, 70], 4, 2, 64, 4, seed=13), scale=0.5)
    case = replace(case, block_tables=torch.nn.functional.pad(case.block_tables, (0, 17)))
    sinks = _sinks(4)
    by_longest = _run_extras(case, 32, 20, 2.0, sinks, max_seq_len=70)
    by_capacity = _run_extras(case, 32, 20, 2.0, sinks, max_seq_len=140)
    assert torch.equal(by_longest, by_capacity)
    short = [0, 1, 2]  # one partition each: written by the first kernel without a merge
    rows = replace(
        case,
        query=case.query[short],
        block_tables=case.block_tables[short],
        seq_lens=case.seq_lens[short],
    )
    alone = _run_extras(rows, 32, 20, 2.0, sinks, max_seq_len=32)
    assert torch.equal(alone, by_capacity[short])
    torch.testing.assert_close(
        by_capacity, _torch_reference(case, 20, 2.0, sinks), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    ("softcap", "sinks", "message"),
    [
        (0.0, None, "logit_softcap must be > 0 and finite, or None, got 0.0"),
        (-5.0, None, "logit_softcap must be > 0"),
        (float("inf"), None, "logit_softcap must be > 0 and finite"),
        (None, torch.zeros(3), r"sinks must be a contiguous \[num_heads = 4\], got \(3,\)"),
        (None, torch.zeros(8)[::2], "sinks must be a contiguous"),
        (None, torch.zeros(4, dtype=torch.bfloat16), "sinks must be float32, got torch.bfloat16"),
        (None, torch.zeros(4, device="meta"), "sinks is on meta"),
    ],
)
def test_bad_softcap_and_sinks_are_refused_by_name(
    softcap: float | None, sinks: torch.Tensor | None, message: str
) -> None:
    case = _make_case([5, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    if sinks is not None and sinks.device.type != "meta":
        sinks = sinks.to(DEVICE)
    with pytest.raises(ValueError, match=message):
        _run_extras(case, 16, None, softcap, sinks)


# ---- a quantized cache: float8 e4m3 or int8 elements, a K and a V scale per KV head ---------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_folded_rows_full_size_on_gpu() -> None:
    """32 sequences of about 1k tokens with 1 + 4 rows each, bf16, 32 query heads over 8."""
    base = _make_case([1024 - 9 * i for i in range(32)], 32, 8, 128, 16, dtype=torch.bfloat16)
    case, starts = _verify_rows(base, [5, 3, 1, 5] * 8)
    out = _run_folded(case, starts, max_rows=5)
    torch.testing.assert_close(out.float(), _reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_splits", [None, 4])
def test_full_size_on_gpu(num_splits: int | None) -> None:
    """64 seqs of about 1k tokens, bf16, 32 query heads over 8 KV heads of 128."""
    seq_lens = [1024 - 7 * i for i in range(64)]
    case = _make_case(seq_lens, 32, 8, 128, block_size=16, dtype=torch.bfloat16)
    out = _run(case, num_splits)
    torch.testing.assert_close(out.float(), _reference(case), atol=2e-2, rtol=2e-2)
