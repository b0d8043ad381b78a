"""Attention backends (torch reference, Triton, CPU kernel) against a naive float64 softmax attention on
random paged inputs, with and without soft-capped logits, attention sinks and a sliding window."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.attention import torch_ref
from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu
from engine.kernels.cpu.paged_prefill_attention import paged_prefill_attention_cpu
from engine.kv_cache.kv_quantization import (
    dequantize_kv,
    is_quantized,
    quantize_kv,
    scales_from_amax,
    storage_dtype,
)

NUM_BLOCKS = 1024


def _naive_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.double().repeat_interleave(group, dim=1)
    value = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), key) * scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    context_pos = torch.arange(seq_len)[None, :]
    scores.masked_fill_(context_pos > query_pos, float("-inf"))
    if sliding_window is not None:
        scores.masked_fill_(context_pos <= query_pos - sliding_window, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
    # the sink: one more position per head, with no value
    sink_column = sinks.double()[:, None, None].expand(-1, query_len, 1)
    weights = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, value)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_decode_seqs", [3, 37])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096, 1])  # CPU decode: 1 chunk, some, 1/seq
def test_mixed_batch_matches_naive(
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    num_decode_seqs: int,
    chunk_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch_ref, "_CHUNK_BYTES", chunk_bytes)
    _check_mixed_batch(
        TorchAttentionBackend(), num_heads, num_kv_heads, block_size, num_decode_seqs
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_decode_seqs", [3, 11])
def test_triton_mixed_batch_matches_naive(
    num_heads: int, num_kv_heads: int, block_size: int, num_decode_seqs: int
) -> None:
    """The Triton kernels (in the interpreter without a GPU) behind the same interface."""
    _check_mixed_batch(
        TritonAttentionBackend(), num_heads, num_kv_heads, block_size, num_decode_seqs
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_decode_seqs", [3, 37])
def test_cpu_mixed_batch_matches_naive(
    num_heads: int, num_kv_heads: int, block_size: int, num_decode_seqs: int
) -> None:
    """The C decode kernel (prefill through the torch reference) behind the same interface."""
    _check_mixed_batch(CpuAttentionBackend(), num_heads, num_kv_heads, block_size, num_decode_seqs)


def _check_mixed_batch(
    backend: AttentionBackend,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    num_decode_seqs: int,
    scale: float = 0.3,
    kv_cache_dtype: str = "auto",
    **extras: Any,  # sliding_window, logit_softcap, sinks
) -> None:
    """Prefills (fresh, after a cached prefix, one token) then decodes, in one forward. With a
    quantized cache the naive attention reads K/V as stored and read back (quantize, then
    dequantize, by each head's scales): a backend must store and read by those rules."""
    torch.manual_seed(0)
    head_dim = 16
    rng = random.Random(num_decode_seqs)
    # (context length after this step, new tokens): prefills first, then decodes
    seqs = [(23, 23), (40, 9), (2, 2), (1, 1)]
    seqs += [(rng.randint(1, 70), 1) for _ in range(num_decode_seqs - 1)]
    num_prefill_seqs = 3
    blocks = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(blocks)
    dtype = storage_dtype(kv_cache_dtype, torch.float32)
    cache = torch.zeros(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype=dtype)
    kv_scales = None
    if is_quantized(kv_cache_dtype):
        # randn's K/V at most ~4.5: heads between clamping some values and plenty of room
        amax = torch.linspace(2.5, 6.0, 2 * num_kv_heads).view(2, num_kv_heads)
        kv_scales = scales_from_amax(kv_cache_dtype, amax)
        extras = {**extras, "kv_scales": kv_scales}
    tables, queries, expected = [], [], []
    new_slots, new_keys, new_values = [], [], []  # of the new tokens, written all at once
    for seq_len, query_len in seqs:
        table = [blocks.pop() for _ in range(-(-seq_len // block_size))]
        key, value = torch.randn(2, seq_len, num_kv_heads, head_dim)
        positions = torch.arange(seq_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        cached = seq_len - query_len
        # the prefix
        backend.write_kv(cache, key[:cached], value[:cached], slots[:cached], kv_scales)
        new_slots.append(slots[cached:])
        new_keys.append(key[cached:])
        new_values.append(value[cached:])
        query = torch.randn(query_len, num_heads, head_dim)
        tables.append(table)
        queries.append(query)
        if kv_scales is not None:
            key = dequantize_kv(quantize_kv(key, kv_scales[0], dtype), kv_scales[0], key.dtype)
            value = dequantize_kv(
                quantize_kv(value, kv_scales[1], dtype), kv_scales[1], value.dtype
            )
        naive_extras = {name: v for name, v in extras.items() if name != "kv_scales"}
        expected.append(_naive_attention(query, key, value, scale, **naive_extras))
    slot_mapping = torch.cat(new_slots)
    new_key, new_value = torch.cat(new_keys), torch.cat(new_values)
    backend.write_kv(cache, new_key, new_value, slot_mapping, kv_scales)
    metadata = _metadata(seqs, num_prefill_seqs, tables, slot_mapping)
    out = backend.forward(torch.cat(queries), cache, metadata, scale, **extras)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


BACKENDS = {
    "torch": TorchAttentionBackend,
    "cpu": CpuAttentionBackend,
    "triton": TritonAttentionBackend,
}
# a cap of 1.5 bends logits of a scale of 1 (std 4 at head_dim 16) hard; sinks span the logits
EXTRAS: dict[str, dict[str, Any]] = {
    "softcap": {"logit_softcap": 1.5},
    "sinks": {"sinks": torch.linspace(-3.0, 4.0, 4)},
    "both-window-7": {
        "logit_softcap": 1.5,
        "sinks": torch.linspace(-3.0, 4.0, 4),
        "sliding_window": 7,
    },
}


@pytest.mark.parametrize("extras", EXTRAS, ids=list(EXTRAS))
@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_softcap_and_sinks_match_naive(backend: str, extras: str) -> None:
    """Each backend's forward passes a soft-cap, sinks and a window on to its prefills and
    its decodes alike (GQA: 4 heads over 2)."""
    _check_mixed_batch(BACKENDS[backend](), 4, 2, 4, 3, scale=1.0, **EXTRAS[extras])


QUANTIZED_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "window-7": {"sliding_window": 7},
    "softcap-sinks": {"logit_softcap": 1.5, "sinks": torch.linspace(-3.0, 4.0, 6)},
}


@pytest.mark.parametrize("case", QUANTIZED_CASES, ids=list(QUANTIZED_CASES))
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_quantized_cache_matches_naive(backend: str, kv_cache_dtype: str, case: str) -> None:
    """Each backend stores K/V in a quantized cache by the per-head scales and reads them
    back as the values they stand for, in prefills and decodes alike (GQA: 6 heads over 2)."""
    extras = QUANTIZED_CASES[case]
    _check_mixed_batch(BACKENDS[backend](), 6, 2, 4, 5, kv_cache_dtype=kv_cache_dtype, **extras)


def test_quantized_write_stores_by_the_rules() -> None:
    """The reference stores what quantize_kv makes of each head by its own scale: float8
    e4m3 saturating at 448, int8 rounding half to even and clamping at 127."""
    key = torch.tensor([[[1.0, -2.5], [900.0, 0.75]]])  # [1 token, 2 heads, head_dim 2]
    value = torch.tensor([[[0.5, 3.0], [-2.0, 254.9]]])
    scales = torch.tensor([[1.0, 0.5], [1.0, 2.0]])  # [K, V] x heads
    for kv_cache_dtype, stored_key, stored_value in (
        ("fp8_e4m3", [[1.0, -2.5], [448.0, 1.5]], [[0.5, 3.0], [-1.0, 128.0]]),
        ("int8", [[1.0, -2.0], [127.0, 2.0]], [[0.0, 3.0], [-1.0, 127.0]]),
    ):
        cache = torch.zeros(2, 2, 2, 2, 2, dtype=storage_dtype(kv_cache_dtype, torch.float32))
        TorchAttentionBackend().write_kv(cache, key, value, torch.tensor([3]), scales)
        assert cache[0, 1, 1].float().tolist() == stored_key
        assert cache[1, 1, 1].float().tolist() == stored_value
        assert int((cache.float() != 0).sum()) == 8 - (kv_cache_dtype == "int8")


def test_cpu_backend_runs_its_kernels_with_softcap_and_sinks() -> None:
    """The CPU backend's prefills and decodes are its kernels' outputs to the bit, not the
    torch reference's explicit softmax."""
    torch.manual_seed(1)
    cache = torch.randn(2, 64, 4, 2, 16)
    _assert_forward_runs_the_cpu_kernels(
        cache, {"logit_softcap": 1.5, "sinks": torch.linspace(-3.0, 4.0, 4)}
    )


def _assert_forward_runs_the_cpu_kernels(cache: torch.Tensor, extras: dict[str, Any]) -> None:
    """The CPU backend's forward over ``cache`` (64 blocks, 2 KV heads; 4 query heads, window
    7, ``extras``) equals its prefill and decode kernels' outputs to the bit, and the torch
    reference's within tolerance but not to the bit (which tells the two paths apart)."""
    scale, head_dim = 1.0, cache.shape[-1]
    seqs = [(23, 23), (40, 9), (30, 1), (12, 1)]
    tables = [list(range(start, start + 10)) for start in (0, 10, 20, 30)]
    metadata = _metadata(seqs, 2, tables, torch.zeros(34, dtype=torch.long))
    query = torch.randn(34, 4, head_dim)
    out = CpuAttentionBackend().forward(query, cache, metadata, scale, 7, **extras)
    starts = torch.tensor(metadata.prefill_query_start_loc)
    prefill_lens = torch.tensor(metadata.prefill_seq_lens)
    tables_of = (metadata.prefill_block_tables, metadata.decode_block_tables)
    prefills = paged_prefill_attention_cpu(
        query[:32], cache, tables_of[0], starts, prefill_lens, scale, None, 7, **extras
    )
    decodes = paged_decode_attention_cpu(
        query[32:], cache, tables_of[1], metadata.decode_seq_lens, scale, None, 7, **extras
    )
    assert torch.equal(out, torch.cat([prefills, decodes]))
    reference = TorchAttentionBackend().forward(query, cache, metadata, scale, 7, **extras)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert not torch.equal(out, reference)


def _metadata(
    seqs: list[tuple[int, int]],
    num_prefill_seqs: int,
    tables: list[list[int]],
    slot_mapping: torch.Tensor,
) -> AttentionMetadata:
    prefills, decodes = seqs[:num_prefill_seqs], seqs[num_prefill_seqs:]
    start_loc = [0]
    for _, query_len in prefills:
        start_loc.append(start_loc[-1] + query_len)
    return AttentionMetadata(
        num_prefill_seqs=len(prefills),
        num_prefill_tokens=start_loc[-1],
        num_decode_seqs=len(decodes),
        slot_mapping=slot_mapping,
        prefill_query_start_loc=start_loc,
        prefill_seq_lens=[seq_len for seq_len, _ in prefills],
        prefill_block_tables=_padded(tables[:num_prefill_seqs]),
        decode_seq_lens=torch.tensor([seq_len for seq_len, _ in decodes]),
        decode_block_tables=_padded(tables[num_prefill_seqs:]),
        max_decode_seq_len=max(seq_len for seq_len, _ in decodes),
    )


def _padded(tables: list[list[int]]) -> torch.Tensor:  # [num_seqs, max_blocks + 2], 0-padded
    width = max((len(t) for t in tables), default=0) + 2  # wider than needed, as real tables are
    padded = torch.zeros(len(tables), width, dtype=torch.long)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table)
    return padded


def test_write_kv_lands_in_slots() -> None:
    cache = torch.zeros(2, 4, 3, 2, 5)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key, value = torch.randn(2, 3, 2, 5)
    TorchAttentionBackend().write_kv(cache, key, value, torch.tensor([11, 0, 4]))
    torch.testing.assert_close(cache[0, 3, 2], key[0])
    torch.testing.assert_close(cache[1, 0, 0], value[1])
    torch.testing.assert_close(cache[0, 1, 1], key[2])
    assert int((cache != 0).any(dim=(-1, -2)).sum()) == 6


def test_workspace_survives_leaving_inference_mode() -> None:
    """A workspace made under inference_mode must not break a later no_grad call."""
    backend = TorchAttentionBackend()
    cache = torch.randn(2, 8, 4, 1, 8)
    metadata = _metadata([(5, 1)], 0, [[3, 6]], torch.tensor([26]))
    query = torch.randn(1, 2, 8)
    with torch.inference_mode():
        expected = backend.forward(query, cache, metadata, 0.5)
    with torch.no_grad():
        torch.testing.assert_close(backend.forward(query, cache, metadata, 0.5), expected)


def test_backend_resolution_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.attention.selector import get_attention_backend, resolve_attention_backend
    from engine.engine_config import CacheConfig
    from engine.kernels import checks

    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"  # cc is here
    assert resolve_attention_backend("auto", torch.device("cuda", 0)) == "triton"
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), CpuAttentionBackend)
    assert isinstance(get_attention_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    assert isinstance(get_attention_backend("triton", torch.device("cpu")), TritonAttentionBackend)
    with pytest.raises(ValueError, match="attention_backend 'cpu' needs the CPU device"):
        resolve_attention_backend("cpu", torch.device("cuda", 0))
    monkeypatch.setattr(checks, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        resolve_attention_backend("triton", torch.device("cpu"))
    with pytest.raises(
        ValueError, match="attention_backend must be one of auto, torch, triton, cpu"
    ):
        CacheConfig(attention_backend="flash")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_cpu_backend_runs_its_kernels_on_a_quantized_cache(
    kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a float8 e4m3 or int8 cache the CPU backend writes through its kernel (the
    reference's write never runs; the bytes are quantize_kv's), and its prefills and decodes
    are its kernels' outputs to the bit, with a window, soft-cap and sinks."""
    torch.manual_seed(2)
    block_size, num_kv_heads, head_dim = 4, 2, 16
    dtype = storage_dtype(kv_cache_dtype, torch.float32)
    cache = torch.zeros(2, 64, block_size, num_kv_heads, head_dim, dtype=dtype)
    kv_scales = scales_from_amax(kv_cache_dtype, torch.linspace(2.5, 6.0, 4).view(2, 2))
    key, value = torch.randn(2, 64 * block_size, num_kv_heads, head_dim)
    slots = torch.randperm(64 * block_size)  # every slot, in no order

    def reference_write(*args: Any) -> None:
        raise AssertionError("the torch reference's write_kv ran")

    with monkeypatch.context() as patched:
        patched.setattr(TorchAttentionBackend, "write_kv", reference_write)
        CpuAttentionBackend().write_kv(cache, key, value, slots, kv_scales)
    stored = cache.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)[:, slots]
    for plane, rows in enumerate((key, value)):
        expected = quantize_kv(rows, kv_scales[plane], dtype).view(torch.uint8)
        assert torch.equal(stored[plane], expected)
    extras = {"logit_softcap": 1.5, "sinks": torch.linspace(-3.0, 4.0, 4), "kv_scales": kv_scales}
    _assert_forward_runs_the_cpu_kernels(cache, extras)
