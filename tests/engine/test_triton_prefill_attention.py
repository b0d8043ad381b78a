"""The Triton paged prefill-attention kernel against a naive torch reference on random inputs.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so shapes stay small; most cases shrink the tiles so that queries span several of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.paged_prefill_attention import PrefillTiling, paged_prefill_attention
from engine.kv_cache.kv_quantization import (
    dequantize_kv,
    quantize_kv,
    scales_from_amax,
    storage_dtype,
)

# (context length after this step, new tokens) per seq: fresh prompts have both equal; the last
# has its first new token one short of a 16-position tile edge (the unmasked/diagonal split)
MIXED_SEQS = [(37, 37), (50, 13), (1, 1), (19, 19), (46, 16)]
# 32 rows per program and 16 KV positions per tile: short seqs still span several
SMALL_TILES = PrefillTiling(block_m=32, block_n=16)


@dataclass(frozen=True)
class PrefillCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache_layer: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seqs: list[tuple[int, int]]  # (seq_len, query_len) per seq
    scale: float
    tiling: PrefillTiling
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads] float32
    kv_scales: torch.Tensor | None = None  # [2, num_kv_heads] float32: a quantized cache's

    @property
    def max_query_len(self) -> int:
        return max(query_len for _, query_len in self.seqs)

    def run(self) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return paged_prefill_attention(
            self.query,
            self.kv_cache_layer,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.scale,
            self.max_query_len,
            self.tiling,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
            sinks=self.sinks,
            kv_scales=self.kv_scales,
        )


def _make_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    tiling: PrefillTiling = SMALL_TILES,
) -> PrefillCase:
    """Random cache and queries; each seq's blocks drawn from a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    tables = []
    num_blocks = sum(-(-seq_len // block_size) for seq_len, _ in seqs) + 3  # a few unused
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    for seq_len, _ in seqs:
        tables.append([pool.pop() for _ in range(-(-seq_len // block_size))])
    width = max(len(table) for table in tables) + 2  # padded wider than needed
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    num_tokens = sum(query_len for _, query_len in seqs)
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    starts = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0)
    return PrefillCase(
        query=query.to(dtype=dtype, device=device),
        kv_cache_layer=cache.to(dtype=dtype, device=device),
        query_start_loc=starts.to(dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        seqs=seqs,
        scale=head_dim**-0.5,
        tiling=tiling,
    )


def _reference(case: PrefillCase) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float64
    """Per seq: gather its blocks, bottom-right causal mask (and the sliding window's: a token
    at position p sees p - W + 1 .. p), float64 softmax, GQA by repeat."""
    outputs = []
    cache = case.kv_cache_layer.double()
    device = cache.device
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = case.query.shape[1] // num_kv_heads
    start = 0
    for row, (seq_len, query_len) in enumerate(case.seqs):
        table = case.block_tables[row, : -(-seq_len // block_size)].long()
        key, value = cache[:, table].flatten(1, 2)[:, :seq_len]  # [seq_len, kv_heads, head_dim]
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        query = case.query[start : start + query_len].double()
        scores = torch.einsum("qhd,khd->hqk", query, key) * case.scale
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
        context_pos = torch.arange(seq_len, device=device)[None, :]
        scores.masked_fill_(context_pos > query_pos, float("-inf"))
        if case.sliding_window is not None:
            scores.masked_fill_(context_pos <= query_pos - case.sliding_window, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value))
        start += query_len
    return torch.cat(outputs)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(2, 2, 64, 16), (4, 2, 128, 8), (8, 2, 64, 32), (6, 2, 64, 16), (16, 2, 64, 16)]
    + [(4, 2, 48, 16), (2, 1, 80, 8)],
    ids=["mha", "gqa2", "gqa4", "gqa3-padded", "gqa8", "head-dim-48", "head-dim-80"],
)
def test_mixed_batch_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Fresh prompts, a chunk after a cached prefix and a 1-token prompt in one batch."""
    case = _make_case(MIXED_SEQS, num_heads, num_kv_heads, head_dim, block_size)
    torch.testing.assert_close(case.run().double(), _reference(case), atol=1e-5, rtol=1e-5)


def test_prefix_cache_hits_on_block_edges_match_reference() -> None:
    """What a prefix-cache hit looks like: the cached prefix is whole blocks (32 and 48 of
    16-token blocks), then the rest of the prompt; and a 2-token chunk after a long prefix."""
    case = _make_case([(48, 16), (64, 16), (90, 2)], 8, 2, 64, 16, seed=2)
    torch.testing.assert_close(case.run().double(), _reference(case), atol=1e-5, rtol=1e-5)


def test_a_column_slice_of_the_block_tables_is_read_in_place() -> None:
    """Rows strided past their width, each row contiguous (what decode accepts too)."""
    case = _make_case([(30, 30), (40, 10)], 4, 2, 64, 16)
    wide = torch.zeros(2, 2 * case.block_tables.shape[1], dtype=torch.int32)
    wide[:, : case.block_tables.shape[1]] = case.block_tables
    sliced = replace(case, block_tables=wide[:, : case.block_tables.shape[1]])
    assert not sliced.block_tables.is_contiguous()
    torch.testing.assert_close(sliced.run(), case.run(), atol=0, rtol=0)


def test_default_tiles_match_reference() -> None:
    """The GPU tile sizes (128 rows, 64 positions), in the interpreter: one query tile."""
    case = _make_case([(70, 70), (90, 21)], 8, 2, 64, 16, seed=1, tiling=PrefillTiling())
    torch.testing.assert_close(case.run().double(), _reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype: torch.dtype) -> None:
    case = _make_case(MIXED_SEQS, 4, 2, 64, 16, dtype=dtype, seed=2)
    out = case.run()
    assert out.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.double(), _reference(case), atol=tolerance, rtol=tolerance)


def test_strided_query_from_fused_projection() -> None:
    """Query as a slice of a fused qkv output: rows strided, head_dim contiguous."""
    case = _make_case([(29, 29), (40, 17)], 4, 2, 64, 8, seed=3)
    num_tokens, num_heads, head_dim = case.query.shape
    fused = torch.randn(num_tokens, num_heads + 4, head_dim)  # q heads, then k/v heads
    fused[:, :num_heads] = case.query
    strided = replace(case, query=fused[:, :num_heads])
    assert not strided.query.is_contiguous()
    torch.testing.assert_close(strided.run(), case.run())


def _torch_reference(case: PrefillCase) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The torch backend's output for the case as a step of prefills, from float32 inputs
    (its explicit softmax, with a soft-cap or sinks; a quantized cache read as float32 by its
    scales)."""
    starts = case.query_start_loc.tolist()
    metadata = AttentionMetadata(
        num_prefill_seqs=len(case.seqs),
        num_prefill_tokens=starts[-1],
        num_decode_seqs=0,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),  # unused by forward
        prefill_query_start_loc=starts,
        prefill_seq_lens=case.seq_lens.tolist(),
        prefill_block_tables=case.block_tables.long(),
        decode_seq_lens=torch.zeros(0, dtype=torch.long),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
        max_decode_seq_len=0,
    )
    quantized = case.kv_scales is not None
    return TorchAttentionBackend().forward(
        case.query.float(),
        case.kv_cache_layer if quantized else case.kv_cache_layer.float(),
        metadata,
        case.scale,
        case.sliding_window,
        logit_softcap=case.logit_softcap,
        sinks=case.sinks,
        kv_scales=case.kv_scales,
    )


def test_matches_torch_backend() -> None:
    """Same output as the reference backend given prefill-only metadata."""
    case = _make_case([(45, 45), (33, 10)], 4, 2, 64, 16, seed=4)
    torch.testing.assert_close(case.run(), _torch_reference(case), atol=1e-5, rtol=1e-5)


def test_int64_indices_accepted() -> None:
    case = _make_case([(20, 5)], 2, 1, 64, 16, seed=5)
    wide = replace(
        case,
        query_start_loc=case.query_start_loc.long(),
        seq_lens=case.seq_lens.long(),
        block_tables=case.block_tables.long(),
    )
    torch.testing.assert_close(wide.run(), case.run())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: {"query": c.query[:, :, :32]}, "head_dim"),
        (lambda c: {"query": c.query[0]}, "query must be"),
        (lambda c: {"query": c.query.double()}, "query dtype"),
        (lambda c: {"kv_cache_layer": c.kv_cache_layer.half()}, "kv_cache_layer dtype"),
        (lambda c: {"kv_cache_layer": c.kv_cache_layer[0]}, "kv_cache_layer must be"),
        (
            lambda c: {"kv_cache_layer": c.kv_cache_layer.transpose(3, 4).contiguous().mT},
            "kv_cache_layer must be contiguous",
        ),
        (lambda c: {"query": c.query.mT.contiguous().mT}, "query's last dim"),
        (lambda c: {"query": c.query[:, :3]}, "num_heads"),
        (lambda c: {"query_start_loc": c.query_start_loc.float()}, "query_start_loc must be int"),
        (lambda c: {"query_start_loc": c.query_start_loc[:-1]}, "query_start_loc must be"),
        (lambda c: {"query_start_loc": c.query_start_loc + 1}, "query_start_loc must rise"),
        (lambda c: {"query": c.query[:-1]}, "query_start_loc must rise"),
        (lambda c: {"seq_lens": c.seq_lens - 20}, "seq_lens"),
        (lambda c: {"block_tables": c.block_tables[:, :1].clone()}, "block_tables has"),
        (lambda c: {"block_tables": c.block_tables[:1]}, "block_tables must be"),
        (lambda c: {"block_tables": c.block_tables.mT.contiguous().mT}, "block_tables must be"),
        (lambda c: {"tiling": PrefillTiling(block_n=48)}, "tiling.block_n must be a power of two"),
        (lambda c: {"tiling": PrefillTiling(num_stages=0)}, "tiling.num_stages"),
    ],
)
def test_wrapper_rejects_bad_arguments(
    change: Callable[[PrefillCase], dict[str, Any]], match: str
) -> None:
    """Each bad argument raises ValueError with a message naming it."""
    case = _make_case([(30, 30), (40, 10)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match=match):
        replace(case, **change(case)).run()


def test_wrapper_rejects_short_max_query_len() -> None:
    case = _make_case([(30, 30), (40, 10)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(
            case.query,
            case.kv_cache_layer,
            case.query_start_loc,
            case.seq_lens,
            case.block_tables,
            case.scale,
            max_query_len=29,
        )


# one token, less than a tile of 16, across tiles and blocks, more than every context
@pytest.mark.parametrize("sliding_window", [1, 5, 21, 100])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(2, 2, 64, 16), (8, 2, 64, 8), (6, 2, 48, 16)],
    ids=["mha", "gqa4", "gqa3-head-dim-48"],
)
def test_sliding_window_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int
) -> None:
    """Fresh prompts, a chunk after a cached prefix and a 1-token prompt; a program's tokens
    (32 of them with one head per KV head) start their windows up to two tiles apart."""
    case = _make_case(MIXED_SEQS, num_heads, num_kv_heads, head_dim, block_size, seed=7)
    windowed = replace(case, sliding_window=sliding_window)
    torch.testing.assert_close(windowed.run().double(), _reference(windowed), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [3, 50])
def test_sliding_window_with_the_default_tiles(sliding_window: int) -> None:
    """The GPU tiles: 64 tokens of a program start their windows over several 64-position
    tiles of a short window, within one of a longer one."""
    case = _make_case([(70, 70), (90, 21)], 2, 2, 64, 16, seed=8, tiling=PrefillTiling())
    windowed = replace(case, sliding_window=sliding_window)
    torch.testing.assert_close(windowed.run().double(), _reference(windowed), atol=1e-5, rtol=1e-5)


def test_blocks_before_the_window_are_never_read() -> None:
    """The engine may free the blocks wholly before a sequence's first new token's window:
    their table entries as -1, or pointing at a block of NaN, leave the output as it was, to
    the bit."""
    window, block_size = 12, 8
    case = _make_case([(64, 16), (90, 2), (40, 40)], 4, 2, 64, block_size, seed=9)
    nan_block = torch.full_like(case.kv_cache_layer[:, :1], float("nan"))
    cache = torch.cat([case.kv_cache_layer, nan_block], dim=1)
    windowed = replace(case, kv_cache_layer=cache, sliding_window=window)
    freed = torch.zeros_like(case.block_tables, dtype=torch.bool)
    for row, (seq_len, query_len) in enumerate(case.seqs):
        freed[row, : max(0, seq_len - query_len - window + 1) // block_size] = True
    assert freed.sum(dim=1).tolist() == [4, 9, 0]
    expected = windowed.run()
    torch.testing.assert_close(expected.double(), _reference(windowed), atol=1e-5, rtol=1e-5)
    for entry in (-1, cache.shape[1] - 1):
        tables = case.block_tables.masked_fill(freed, entry)
        assert torch.equal(replace(windowed, block_tables=tables).run(), expected), entry


@pytest.mark.parametrize("sliding_window", [0, -3])
def test_a_window_below_one_token_is_refused(sliding_window: int) -> None:
    case = _make_case([(30, 30), (40, 10)], 4, 2, 64, 16)
    with pytest.raises(
        ValueError, match=f"sliding_window must be >= 1 or None, got {sliding_window}"
    ):
        replace(case, sliding_window=sliding_window).run()


# ---- soft-capped logits (Gemma 2) and attention sinks (gpt-oss) ----------------------------
# (logit soft-cap, with sinks): a cap of 2 bends the logits of a scale of 0.5 (std 4) hard
EXTRAS = {"softcap": (2.0, False), "sinks": (None, True), "both": (2.0, True)}


def _with_extras(case: PrefillCase, extras: str, sliding_window: int | None) -> PrefillCase:
    softcap, with_sinks = EXTRAS[extras]
    num_heads = case.query.shape[1]
    generator = torch.Generator().manual_seed(num_heads)
    sinks = 2 * torch.randn(num_heads, generator=generator) + 1  # some far above the logits
    return replace(
        case,
        scale=0.5,
        sliding_window=sliding_window,
        logit_softcap=softcap,
        sinks=sinks.to(case.query.device) if with_sinks else None,
    )


@pytest.mark.parametrize("sliding_window", [None, 5], ids=["whole", "window-5"])
@pytest.mark.parametrize("extras", EXTRAS, ids=list(EXTRAS))
def test_softcap_and_sinks_match_the_torch_reference(
    extras: str, sliding_window: int | None
) -> None:
    """Fresh prompts, a chunk after a cached prefix and a 1-token prompt, in programs of 8
    tokens and tiles of 16 positions: a window of 5 masks each row in the tiles it starts in."""
    case = _make_case(MIXED_SEQS, 8, 2, 64, 8, seed=10)
    case = _with_extras(case, extras, sliding_window)
    torch.testing.assert_close(case.run(), _torch_reference(case), atol=2e-5, rtol=1e-5)


def test_softcap_and_sinks_in_bfloat16() -> None:
    case = _make_case(MIXED_SEQS, 8, 2, 64, 8, dtype=torch.bfloat16, seed=11)
    case = _with_extras(case, "both", 21)
    out = case.run()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _torch_reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"logit_softcap": 0.0}, "logit_softcap must be > 0 and finite, or None, got 0.0"),
        ({"logit_softcap": float("nan")}, "logit_softcap must be > 0"),
        ({"sinks": torch.zeros(2)}, r"sinks must be a contiguous \[num_heads = 4\], got \(2,\)"),
        ({"sinks": torch.zeros(4).double()}, "sinks must be float32, got torch.float64"),
        ({"sinks": torch.zeros(4, device="meta")}, "sinks is on meta"),
    ],
)
def test_bad_softcap_and_sinks_are_refused_by_name(change: dict[str, Any], match: str) -> None:
    case = _make_case([(30, 30), (40, 10)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match=match):
        replace(case, **change).run()


# ---- a quantized cache: float8 e4m3 or int8 elements, a K and a V scale per KV head ---------
def _quantized(case: PrefillCase, kv_cache_dtype: str) -> tuple[PrefillCase, PrefillCase]:
    """``case`` with its cache as a quantized cache stores it, by per-head scales (the first
    head's below what its largest magnitude needs: some values clamp; the last's with room);
    and ``case`` with the float32 cache the stored elements stand for (the reference's)."""
    cache = case.kv_cache_layer.float()  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    amax = cache.abs().amax(dim=(1, 2, 4))  # [2, num_kv_heads]
    spread = torch.linspace(0.4, 1.5, cache.shape[3], device=cache.device)
    scales = scales_from_amax(kv_cache_dtype, amax) * spread
    into = storage_dtype(kv_cache_dtype, torch.float32)
    stored = torch.empty_like(cache, dtype=into)
    read = torch.empty_like(cache)
    for plane in (0, 1):
        elements = quantize_kv(cache[plane].flatten(0, 1), scales[plane], into)
        stored[plane] = elements.view(cache.shape[1:])
        read[plane] = dequantize_kv(elements, scales[plane], torch.float32).view(cache.shape[1:])
    quantized = replace(case, kv_cache_layer=stored, kv_scales=scales)
    return quantized, replace(case, kv_cache_layer=read)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(8, 2, 64, 8), (6, 2, 48, 16)],
    ids=["gqa4", "gqa3-head-dim-48"],
)
def test_quantized_cache_matches_reference(
    kv_cache_dtype: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Fresh prompts, a chunk after a cached prefix and a 1-token prompt over a quantized
    cache: each element read as element * its head's scale (the K scale in the logits, the V
    scale in the output)."""
    case = _make_case(MIXED_SEQS, num_heads, num_kv_heads, head_dim, block_size, seed=12)
    quantized, read = _quantized(case, kv_cache_dtype)
    torch.testing.assert_close(quantized.run().double(), _reference(read), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_with_window_softcap_and_sinks(kv_cache_dtype: str) -> None:
    """A window of 5, a soft-cap and sinks over a quantized cache, vs the torch backend
    reading the same cache."""
    case = _with_extras(_make_case(MIXED_SEQS, 8, 2, 64, 8, seed=13), "both", 5)
    quantized, _ = _quantized(case, kv_cache_dtype)
    torch.testing.assert_close(quantized.run(), _torch_reference(quantized), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_under_bfloat16_queries(kv_cache_dtype: str) -> None:
    """The engine's case: bfloat16 queries over a quantized cache (its elements exact in
    bfloat16), the output in bfloat16."""
    case = _make_case([(37, 37), (50, 13)], 4, 2, 64, 16, dtype=torch.bfloat16, seed=14)
    quantized, read = _quantized(case, kv_cache_dtype)
    out = quantized.run()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(read), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_scales": None}, "a torch.int8 kv_cache_layer needs kv_scales"),
        (
            {"kv_scales": torch.ones(2, 3)},
            r"kv_scales must be a contiguous \[2, num_kv_heads = 2\]",
        ),
        ({"kv_scales": torch.ones(2, 2).half()}, "kv_scales must be float32, got torch.float16"),
        ({"query": torch.zeros(40, 4, 64, dtype=torch.float64)}, "query dtype must be one of"),
    ],
)
def test_bad_quantized_arguments_are_refused_by_name(change: dict[str, Any], match: str) -> None:
    quantized, read = _quantized(_make_case([(30, 30), (40, 10)], 4, 2, 64, 16), "int8")
    with pytest.raises(ValueError, match=match):
        replace(quantized, **change).run()
    with pytest.raises(ValueError, match="kv_scales are for a quantized cache"):
        replace(read, kv_scales=quantized.kv_scales).run()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_full_size_bf16_on_gpu() -> None:
    """4 seqs, 8k new tokens, two of them after a cached prefix; 32 heads / 8 kv heads."""
    seqs = [(3000, 3000), (2600, 1600), (2048, 2048), (2500, 1544)]
    assert sum(query_len for _, query_len in seqs) == 8192
    case = _make_case(
        seqs, 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda", seed=6, tiling=PrefillTiling()
    )
    out = case.run()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), _reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_full_size_bf16_on_gpu(kv_cache_dtype: str) -> None:
    """2 seqs, 2.5k new tokens, one after a cached prefix; 32 heads / 8 kv heads, bf16 queries
    over a float8 or int8 cache, with the engine's tiles."""
    seqs = [(2048, 2048), (1500, 500)]
    case = _make_case(
        seqs, 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda", seed=15, tiling=PrefillTiling()
    )
    quantized, read = _quantized(case, kv_cache_dtype)
    out = quantized.run()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), _reference(read), atol=2e-2, rtol=2e-2)
