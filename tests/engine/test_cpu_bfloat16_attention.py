"""A bfloat16 KV cache (a bfloat16 model's) through the CPU kernels: the decode and prefill
kernels read its elements as the float32 they stand for exactly, so each output equals, bit for
bit, the kernel's on the cache widened to float32 (every path: GQA, in-place and transposed
tiles, sliding windows, soft-capped logits, sinks, a latent cache's one plane); the write kernel
copies bfloat16 rows bit for bit; the CPU backend runs a bfloat16 model's attention through
them in float32 and rounds its output once, where the torch reference ran bfloat16 SDPA, and
takes a bfloat16 model's rows over a float8 / int8 cache too."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu.kv_cache_write import write_kv_cache_cpu
from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu
from engine.kernels.cpu.paged_prefill_attention import paged_prefill_attention_cpu
from engine.kv_cache.kv_quantization import quantize_kv, scales_from_amax, storage_dtype
from tests.engine.paged_tables import scattered_block_tables
from tests.engine.test_attention_backends import _metadata
from tests.engine.test_triton_latent_attention import _make_batch

EXTRAS = {
    "plain": {},
    "window": {"sliding_window": 7},
    "softcap": {"logit_softcap": 5.0},
    "sinks": {"sinks": torch.linspace(-1.0, 2.0, 8)},
}


def _cache(
    seq_lens: list[int], planes: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 cache of random entries and each sequence's scattered block table."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    shape = (planes, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    return cache, scattered_block_tables(seq_lens, block_size, num_blocks, generator)


def _extras(name: str, num_heads: int) -> dict[str, Any]:
    extras = dict(EXTRAS[name])
    if "sinks" in extras:
        extras["sinks"] = extras["sinks"][:num_heads].contiguous()
    return extras


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])  # 40: the row-by-row walk
def test_decode_reads_a_bfloat16_cache_as_its_float32_widening(
    extras: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    seq_lens = [1, 16, 37, 80]
    cache, tables = _cache(seq_lens, 2, num_kv_heads, head_dim, 16, seed=head_dim + num_heads)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    kwargs = _extras(extras, num_heads)
    widened = paged_decode_attention_cpu(query, cache.float(), tables, lens, 0.2, **kwargs)
    out = paged_decode_attention_cpu(query, cache, tables, lens, 0.2, **kwargs)
    assert out.dtype == torch.float32
    assert torch.equal(out, widened)


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_prefill_reads_a_bfloat16_cache_as_its_float32_widening(
    extras: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Items of few rows (K read in place, a tile's rows widened first) and of many (the
    transposed tiles); head_dim 48 takes the transposed tiles at any row count; prompts after a
    cached prefix and whole ones."""
    rng = random.Random(head_dim * num_heads)
    query_lens = [1, 5, 70, 33, *(rng.randint(1, 90) for _ in range(2))]
    seq_lens = [n + rng.choice([0, rng.randint(1, 60)]) for n in query_lens]
    cache, tables = _cache(seq_lens, 2, num_kv_heads, head_dim, 16, seed=head_dim)
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    starts = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    kwargs = _extras(extras, num_heads)
    args = (tables, starts, lens, 0.2)
    widened = paged_prefill_attention_cpu(query, cache.float(), *args, **kwargs)
    out = paged_prefill_attention_cpu(query, cache, *args, **kwargs)
    assert torch.equal(out, widened)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_latent_cache_in_bfloat16_is_read_once_for_keys_and_values(num_threads: int) -> None:
    """A latent cache's one plane (entries of DeepSeek's 512 + 64): decode rows and prompt rows
    over it, as over its float32 widening."""
    seq_lens = [40, 3, 77]
    cache, tables = _cache(seq_lens, 1, 1, 576, 16, seed=3)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    for query_lens in ([1, 1, 1], [40, 2, 30]):
        query = torch.randn(sum(query_lens), 16, 576)
        starts = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0)
        args = (tables, starts, lens, 0.05)
        widened = paged_prefill_attention_cpu(query, cache.float(), *args, num_threads=num_threads)
        out = paged_prefill_attention_cpu(query, cache, *args, num_threads=num_threads)
        assert torch.equal(out, widened)


def test_the_write_kernel_copies_bfloat16_rows_bit_for_bit() -> None:
    cache = torch.zeros(2, 6, 4, 2, 32, dtype=torch.bfloat16)
    # rows where the qkv projection leaves them: every token's K then V, a stride apart
    qkv = torch.randn(5, 3 * 64).to(torch.bfloat16)
    key, value = qkv[:, 64:128].view(5, 2, 32), qkv[:, 128:].view(5, 2, 32)
    slots = torch.tensor([3, 17, -1, 0, 23])  # -1: padding, skipped
    write_kv_cache_cpu(cache, key, value, slots)
    expected = torch.zeros_like(cache).view(2, 24, 2, 32)
    kept = slots >= 0
    expected[0, slots[kept]] = key[kept]
    expected[1, slots[kept]] = value[kept]
    assert torch.equal(cache.view(torch.int16), expected.view_as(cache).view(torch.int16))


def test_a_bfloat16_cache_refuses_float32_rows_by_name() -> None:
    cache = torch.zeros(2, 4, 4, 2, 32, dtype=torch.bfloat16)
    rows = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match="key must be bfloat16 .*a bfloat16 cache"):
        write_kv_cache_cpu(cache, rows, rows.bfloat16(), torch.tensor([0, 1, 2]))


@dataclass
class _Step:
    """A step of prefills (fresh, after a cached prefix) and decodes over a cache that holds
    every position before the step's new tokens; the new tokens' K/V to write."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim] bfloat16
    cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim] bfloat16
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim] bfloat16
    value: torch.Tensor
    metadata: AttentionMetadata


def _step(num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64) -> _Step:
    block_size = 4
    seqs = [(23, 23), (40, 9), (37, 1), (5, 1), (61, 1)]  # (context, new tokens); 2 prefills
    generator = torch.Generator().manual_seed(11)
    blocks = torch.randperm(64, generator=generator).tolist()
    tables = [[blocks.pop() for _ in range(-(-n // block_size))] for n, _ in seqs]
    cache = torch.randn(2, 64, block_size, num_kv_heads, head_dim, generator=generator)
    slots = []
    for table, (seq_len, query_len) in zip(tables, seqs, strict=True):
        positions = torch.arange(seq_len - query_len, seq_len)
        slots.append(torch.tensor(table)[positions // block_size] * block_size + positions % 4)
    metadata = _metadata(seqs, 2, tables, torch.cat(slots))
    num_tokens = sum(n for _, n in seqs)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=generator)
    bf16 = torch.bfloat16
    return _Step(query.to(bf16), cache.to(bf16), key.to(bf16), value.to(bf16), metadata)


@pytest.mark.parametrize("extras", ["plain", "window", "sinks"])
def test_the_backend_attends_in_float32_and_rounds_once(extras: str) -> None:
    """With a bfloat16 query and cache the output is the float32 attention over the same
    values, rounded to bfloat16 once (the reference's bfloat16 SDPA rounded its scores and
    probabilities too); the new K/V are stored as they are."""
    step = _step()
    kwargs = _extras(extras, 8)
    backend = CpuAttentionBackend()
    backend.write_kv(step.cache, step.key, step.value, step.metadata.slot_mapping)
    assert torch.equal(step.cache[0].view(-1, 2, 64)[step.metadata.slot_mapping], step.key)
    out = backend.forward(step.query, step.cache, step.metadata, 0.125, **kwargs)
    widened = backend.forward(
        step.query.float(), step.cache.float(), step.metadata, 0.125, **kwargs
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, widened.to(torch.bfloat16))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_a_bfloat16_model_over_a_quantized_cache_takes_the_kernels(kv_cache_dtype: str) -> None:
    """bfloat16 rows into a float8 / int8 cache: stored as from their float32 values (as
    quantize_kv stores), read by the kernels in float32, the output rounded to bfloat16 once."""
    step = _step()
    dtype = storage_dtype(kv_cache_dtype, torch.bfloat16)
    amax = torch.linspace(2.5, 6.0, 4).view(2, 2)
    kv_scales = scales_from_amax(kv_cache_dtype, amax)
    backend = CpuAttentionBackend()
    caches = []
    for rows in (step.key, step.value), (step.key.float(), step.value.float()):
        cache = quantize_kv(step.cache.float().flatten(0, 2), kv_scales[0], dtype)
        cache = cache.view(step.cache.shape).clone()
        backend.write_kv(cache, *rows, step.metadata.slot_mapping, kv_scales)
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    out = backend.forward(step.query, caches[0], step.metadata, 0.125, kv_scales=kv_scales)
    widened = backend.forward(
        step.query.float(), caches[0], step.metadata, 0.125, kv_scales=kv_scales
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, widened.to(torch.bfloat16))


def test_the_backend_runs_latent_attention_in_bfloat16_as_in_float32() -> None:
    batch = _make_batch([(21, 21), (38, 9)], [1, 26, 40], num_heads=16, width=576, value_dim=512)
    query, cache = batch.query.to(torch.bfloat16), batch.cache_layer.to(torch.bfloat16)
    backend = CpuAttentionBackend()
    out = backend.forward_latent(query, cache, batch.metadata, batch.scale, 512)
    widened = backend.forward_latent(query.float(), cache.float(), batch.metadata, batch.scale, 512)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 16, 512)
    assert torch.equal(out, widened.to(torch.bfloat16))
