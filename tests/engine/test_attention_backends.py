"""Attention backends (torch reference, Triton, CPU kernel) against a naive float64 softmax attention on
random paged inputs."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import torch_ref
from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend

NUM_BLOCKS = 1024


def _naive_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.double().repeat_interleave(group, dim=1)
    value = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), key) * scale
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores.masked_fill_(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


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
) -> None:
    """Prefills (fresh, after a cached prefix, one token) then decodes, in one forward."""
    torch.manual_seed(0)
    head_dim, scale = 16, 0.3
    rng = random.Random(num_decode_seqs)
    # (context length after this step, new tokens): prefills first, then decodes
    seqs = [(23, 23), (40, 9), (2, 2), (1, 1)]
    seqs += [(rng.randint(1, 70), 1) for _ in range(num_decode_seqs - 1)]
    num_prefill_seqs = 3
    blocks = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(blocks)
    cache = torch.zeros(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    tables, queries, expected = [], [], []
    new_slots, new_keys, new_values = [], [], []  # of the new tokens, written all at once
    for seq_len, query_len in seqs:
        table = [blocks.pop() for _ in range(-(-seq_len // block_size))]
        key, value = torch.randn(2, seq_len, num_kv_heads, head_dim)
        positions = torch.arange(seq_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        cached = seq_len - query_len
        backend.write_kv(cache, key[:cached], value[:cached], slots[:cached])  # the prefix
        new_slots.append(slots[cached:])
        new_keys.append(key[cached:])
        new_values.append(value[cached:])
        query = torch.randn(query_len, num_heads, head_dim)
        tables.append(table)
        queries.append(query)
        expected.append(_naive_attention(query, key, value, scale))
    slot_mapping = torch.cat(new_slots)
    backend.write_kv(cache, torch.cat(new_keys), torch.cat(new_values), slot_mapping)
    metadata = _metadata(seqs, num_prefill_seqs, tables, slot_mapping)
    out = backend.forward(torch.cat(queries), cache, metadata, scale)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


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
