"""The Triton paged decode-attention kernels over a quantized KV cache (float8 e4m3 and int8
elements with per-head scales) vs the reference reading the values the elements stand for.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which is slow: shapes stay small.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.kernels.paged_decode_attention import paged_decode_attention
from engine.kv_cache.kv_quantization import (
    dequantize_kv,
    quantize_kv,
    scales_from_amax,
    storage_dtype,
)
from tests.engine.test_triton_decode_attention import (
    DecodeCase,
    _make_case,
    _reference,
    _sinks,
    _torch_reference,
    _verify_rows,
)


def _quantized(
    case: DecodeCase, kv_cache_dtype: str
) -> tuple[DecodeCase, torch.Tensor, DecodeCase]:
    """``case`` with its cache as a quantized cache stores it, by per-head scales: the first
    head's below what its largest magnitude needs (some values clamp), the last's with room;
    the scales ([2, num_kv_heads] float32); and ``case`` with the float32 cache the stored
    elements stand for (the reference's)."""
    cache = case.kv_cache_layer.float()  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    amax = cache.abs().amax(dim=(1, 2, 4))  # [2, num_kv_heads]
    spread = torch.linspace(0.4, 1.5, cache.shape[3], device=cache.device)
    scales = scales_from_amax(kv_cache_dtype, amax) * spread
    into = storage_dtype(kv_cache_dtype, torch.float32)
    stored = torch.empty_like(cache, dtype=into)
    read = torch.empty_like(cache)
    for plane in (0, 1):
        tokens = cache[plane].flatten(0, 1)  # [num_slots, num_kv_heads, head_dim]
        elements = quantize_kv(tokens, scales[plane], into)
        stored[plane] = elements.view(cache.shape[1:])
        read[plane] = dequantize_kv(elements, scales[plane], torch.float32).view(cache.shape[1:])
    return replace(case, kv_cache_layer=stored), scales, replace(case, kv_cache_layer=read)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "head_dim", "num_splits"),
    [(8, 2, 8, 64, 3), (6, 2, 4, 48, None)],
    ids=["gqa4-3-splits", "gqa3-head-dim-48"],
)
def test_quantized_cache_matches_reference(
    kv_cache_dtype: str,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    num_splits: int | None,
) -> None:
    """Each stored element is read as element * its head's scale (the K scale in the logits,
    the V scale in the output), in one partition and merged over several."""
    seq_lens = [1, 2 * block_size, 3 * block_size + 5, 37]
    case = _make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=14)
    stored, scales, read = _quantized(case, kv_cache_dtype)
    out = paged_decode_attention(
        stored.query,
        stored.kv_cache_layer,
        stored.block_tables,
        stored.seq_lens,
        stored.scale,
        num_splits,
        kv_scales=scales,
    )
    torch.testing.assert_close(out, _reference(read), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_with_window_softcap_and_sinks(kv_cache_dtype: str) -> None:
    """A window of 21, a soft-cap and sinks, in one partition and in partitions of 16, vs the
    torch backend reading the same quantized cache."""
    case = replace(_make_case([1, 16, 37, 70], 8, 2, 64, 8, seed=15), scale=0.5)
    stored, scales, _ = _quantized(case, kv_cache_dtype)
    sinks = _sinks(8)
    expected = _torch_reference(stored, 21, 2.0, sinks, kv_scales=scales)
    for tokens_per_split in (80, 16):
        out = paged_decode_attention(
            stored.query,
            stored.kv_cache_layer,
            stored.block_tables,
            stored.seq_lens,
            stored.scale,
            tokens_per_split=tokens_per_split,
            sliding_window=21,
            logit_softcap=2.0,
            sinks=sinks,
            kv_scales=scales,
        )
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_over_folded_windowed_rows(kv_cache_dtype: str) -> None:
    """A verify step's rows (a token and its drafts) folded per sequence, each in its own
    window of 13, partitions of 16."""
    base = _make_case([9, 70, 40], num_heads=8, num_kv_heads=2, head_dim=64, block_size=4, seed=16)
    case, starts = _verify_rows(base, [3, 5, 1])
    stored, scales, read = _quantized(case, kv_cache_dtype)
    out = paged_decode_attention(
        stored.query,
        stored.kv_cache_layer,
        stored.block_tables,
        stored.seq_lens,
        stored.scale,
        tokens_per_split=16,
        row_starts=starts,
        max_rows_per_seq=5,
        sliding_window=13,
        kv_scales=scales,
    )
    torch.testing.assert_close(out, _reference(read, 13), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_under_bfloat16_queries(kv_cache_dtype: str) -> None:
    """The engine's case: bfloat16 queries over a quantized cache (its elements exact in
    bfloat16), the output in bfloat16."""
    case = _make_case([5, 40, 17], 8, 2, 64, 8, dtype=torch.bfloat16, seed=17)
    stored, scales, read = _quantized(case, kv_cache_dtype)
    args = (stored.query, stored.kv_cache_layer, stored.block_tables, stored.seq_lens)
    out = paged_decode_attention(*args, stored.scale, 3, kv_scales=scales)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(read), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no_scales", "a torch.float8_e4m3fn kv_cache_layer needs kv_scales"),
        ("scales_for_float", "kv_scales are for a quantized cache"),
        ("scales_shape", r"kv_scales must be a contiguous \[2, num_kv_heads = 2\], got \(2,\)"),
        ("scales_device", "kv_scales is on meta"),
        ("query_dtype", "query dtype must be float32, float16 or bfloat16, got torch.float64"),
    ],
)
def test_bad_quantized_arguments_are_refused_by_name(change: str, message: str) -> None:
    case = _make_case([5, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    stored, scales, _ = _quantized(case, "fp8_e4m3")
    query, cache, kv_scales = stored.query, stored.kv_cache_layer, scales
    bad: torch.Tensor | None = kv_scales
    if change == "no_scales":
        bad = None
    elif change == "scales_for_float":
        cache = case.kv_cache_layer
    elif change == "scales_shape":
        bad = kv_scales[0].contiguous()
    elif change == "scales_device":
        bad = torch.empty(2, 2, device="meta")
    elif change == "query_dtype":
        query = query.double()
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(query, cache, case.block_tables, case.seq_lens, 0.1, kv_scales=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_full_size_on_gpu(kv_cache_dtype: str) -> None:
    """64 seqs of about 1k tokens, bf16 queries, 32 heads over 8 KV heads of 128, over a
    float8 or int8 cache (the compiled loads convert its elements to bf16 for the dots)."""
    seq_lens = [1024 - 7 * i for i in range(64)]
    case = _make_case(seq_lens, 32, 8, 128, block_size=16, dtype=torch.bfloat16)
    stored, scales, read = _quantized(case, kv_cache_dtype)
    for num_splits in (None, 4):
        out = paged_decode_attention(
            stored.query,
            stored.kv_cache_layer,
            stored.block_tables,
            stored.seq_lens,
            stored.scale,
            num_splits,
            kv_scales=scales,
        )
        torch.testing.assert_close(out.float(), _reference(read), atol=2e-2, rtol=2e-2)
