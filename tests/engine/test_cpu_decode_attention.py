"""The C decode-attention kernel (engine/kernels/cpu) against a float64 softmax over each
sequence's gathered context (or its sliding window's last positions), with soft-capped logits
(mild and hard-biting) or attention sinks against the torch reference and the float64 one; on
float8 e4m3 and int8 caches against a float64 softmax over what they store, and against the
torch reference; the soft-cap's vectorised tanh against tanh; its argument checks, and how it
is built and cached. (The K/V write kernel's tests are test_cpu_kv_write.py's.)"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import resolve_attention_backend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.cpu import build
from engine.kernels.cpu import paged_decode_attention as kernel_module
from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu
from tests.engine.paged_tables import scattered_block_tables
from tests.engine.quantized_caches import QUANTIZED, stored_as

FLOAT32 = {"atol": 1e-5, "rtol": 1e-5}  # float32 results against a float64 reference


def _case(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, cache, block tables (each seq's blocks a random pick, rows padded wider than
    needed) and seq_lens."""
    generator = torch.Generator().manual_seed(sum(seq_lens) + block_size)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    tables = scattered_block_tables(seq_lens, block_size, num_blocks, generator)
    return query, cache, tables, torch.tensor(seq_lens, dtype=torch.int64)


def _expected(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    block_size = cache.shape[2]
    outputs = []
    for row, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        blocks = tables[row, positions // block_size]
        key = cache[0, blocks, positions % block_size].double()  # [seq_len, kv_heads, dim]
        value = cache[1, blocks, positions % block_size].double()
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", query[row].double(), key) * query.shape[2] ** -0.5
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        if sliding_window is not None:  # the query, at seq_len - 1, sees the last W positions
            scores = scores.masked_fill(positions <= seq_len - 1 - sliding_window, float("-inf"))
        outputs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), value))
    return torch.stack(outputs)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
# 40: a head_dim off the blocked walk's multiples of 16 (the row-by-row walk)
@pytest.mark.parametrize("head_dim", [40, 48, 64, 128])
def test_kernel_matches_a_float64_softmax(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    rng = random.Random(num_heads * 1000 + block_size * 10 + head_dim)
    # length 1, exact multiples of the block size, and ragged lengths
    seq_lens = [1, block_size, 3 * block_size, *(rng.randint(1, 90) for _ in range(9))]
    query, cache, tables, lens = _case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = paged_decode_attention_cpu(query, cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.double(), _expected(query, cache, tables, lens), **FLOAT32)


def _windows(block_size: int) -> list[int]:
    """One position, less than a block, a span across block boundaries, more than any context."""
    return [1, block_size // 2 + 1, 2 * block_size + 3, 10_000]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_a_sliding_window_sees_the_last_positions_only(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    rng = random.Random(num_heads * 1000 + block_size * 10 + head_dim)
    seq_lens = [1, block_size, 3 * block_size, *(rng.randint(1, 90) for _ in range(9))]
    query, cache, tables, lens = _case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    whole = paged_decode_attention_cpu(query, cache, tables, lens, scale)
    for window in _windows(block_size):
        out = paged_decode_attention_cpu(query, cache, tables, lens, scale, sliding_window=window)
        expected = _expected(query, cache, tables, lens, window)
        torch.testing.assert_close(out.double(), expected, **FLOAT32)
    assert torch.equal(out, whole)  # the last window is longer than every context


@pytest.mark.parametrize("stale_block_id", [-1, 2**62])
def test_blocks_wholly_before_the_window_are_neither_read_nor_checked(
    stale_block_id: int,
) -> None:
    """The engine may free the blocks no query can see, so their entries may hold anything;
    the block the window starts in is still checked."""
    block_size, window = 8, 13
    seq_lens = [100, 13, 14, 30, 5, 64]
    query, cache, tables, lens = _case(seq_lens, 8, 2, 64, block_size)
    fresh = paged_decode_attention_cpu(query, cache, tables, lens, 0.125, sliding_window=window)
    stale = tables.clone()
    for row, seq_len in enumerate(seq_lens):
        stale[row, : max(0, seq_len - window) // block_size] = stale_block_id
    assert int((stale == stale_block_id).sum()) == 10 + 0 + 0 + 2 + 0 + 6
    out = paged_decode_attention_cpu(query, cache, stale, lens, 0.125, sliding_window=window)
    assert torch.equal(out, fresh)
    expected = _expected(query, cache, tables, lens, window)
    torch.testing.assert_close(out.double(), expected, **FLOAT32)
    with pytest.raises(ValueError, match=r"sequence 0: .*entries in \[0, "):
        paged_decode_attention_cpu(query, cache, stale, lens, 0.125)  # no window: all are read
    stale[0, (100 - window) // block_size] = stale_block_id  # the block the window starts in
    with pytest.raises(ValueError, match="sequence 0: .* from the first block its window reaches"):
        paged_decode_attention_cpu(query, cache, stale, lens, 0.125, sliding_window=window)


@pytest.mark.parametrize("num_threads", [2, 3, 4])
def test_threads_change_no_bit_under_a_sliding_window(num_threads: int) -> None:
    rng = random.Random(num_threads)
    seq_lens = [1, *(rng.randint(1, 300) for _ in range(20))]
    query, cache, tables, lens = _case(seq_lens, 8, 2, 64, 16)
    for window in (1, 9, 40, 257):
        case = (query, cache, tables, lens, 0.125)
        alone = paged_decode_attention_cpu(*case, 1, sliding_window=window)
        shared = paged_decode_attention_cpu(*case, num_threads, sliding_window=window)
        assert torch.equal(alone, shared)


@pytest.mark.parametrize("sliding_window", [0, -1, -4096])
def test_a_window_under_one_position_is_refused_by_name(sliding_window: int) -> None:
    query, cache, tables, lens = _case([20, 9], 4, 2, 64, 8)
    with pytest.raises(
        ValueError, match=f"sliding_window must be None or >= 1, got {sliding_window}"
    ):
        paged_decode_attention_cpu(query, cache, tables, lens, 0.1, sliding_window=sliding_window)


@pytest.mark.parametrize("num_threads", [2, 3, 8])
def test_threads_share_the_sequences_and_change_no_bit(num_threads: int) -> None:
    rng = random.Random(num_threads)
    seq_lens = [1, *(rng.randint(1, 300) for _ in range(20))]  # more seqs than threads, ragged
    query, cache, tables, lens = _case(seq_lens, 8, 2, 64, 16)
    alone = paged_decode_attention_cpu(query, cache, tables, lens, 0.125, num_threads=1)
    shared = paged_decode_attention_cpu(query, cache, tables, lens, 0.125, num_threads=num_threads)
    assert torch.equal(alone, shared)
    torch.testing.assert_close(shared.double(), _expected(query, cache, tables, lens), **FLOAT32)


def test_bad_sequences_and_thread_counts_are_refused_with_threads_on() -> None:
    query, cache, tables, lens = _case([20, 9, 30, 4], 4, 2, 64, 8)
    lens[2] = 0
    with pytest.raises(ValueError, match=r"sequence 2: seq_lens\[2\] = 0"):
        paged_decode_attention_cpu(query, cache, tables, lens, 0.1, num_threads=2)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        paged_decode_attention_cpu(query, cache, tables, lens, 0.1, num_threads=0)


def test_large_scores_stay_finite() -> None:
    """Scores far beyond exp's range: the running max keeps the softmax exact."""
    query, cache, tables, lens = _case([40, 7], 4, 2, 64, 16)
    query *= 60.0
    out = paged_decode_attention_cpu(query, cache, tables, lens, 64**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _expected(query, cache, tables, lens), **FLOAT32)


def test_no_sequences_is_an_empty_result() -> None:
    query, cache, tables, lens = _case([3], 4, 4, 64, 4)
    out = paged_decode_attention_cpu(query[:0], cache, tables[:0], lens[:0], 0.1)
    assert out.shape == (0, 4, 64)


def test_bad_arguments_are_refused_by_name() -> None:
    query, cache, tables, lens = _case([20, 9], 4, 2, 64, 8)
    out_of_range = tables.clone()
    out_of_range[1, 1] = cache.shape[1]  # one past the last block, inside seq 1's length
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 8 + 1
    cases = [
        ((query, cache, out_of_range, lens), r"sequence 1: .*block_tables entries in \[0, "),
        ((query, cache, tables, too_long), r"sequence 0: seq_lens\[0\] = 41 must be in \[1, 40\]"),
        ((query, cache, tables, lens * 0), r"sequence 0: seq_lens\[0\] = 0"),
        ((query.double(), cache, tables, lens), "query must be float32"),
        ((query, cache.half(), tables, lens), "kv_cache_layer must be float32"),
        ((query, cache, tables.int(), lens), "block_tables must be int64"),
        ((query, cache, tables, lens[:1]), r"seq_lens must be a contiguous \[2\]"),
        ((query[:, :3].contiguous(), cache, tables, lens), "multiple of the cache's 2 KV heads"),
        (
            (query[..., :32].contiguous(), cache, tables, lens),
            "query head_dim 32 != kv_cache_layer head_dim 64",
        ),
        ((query, cache[0], tables, lens), "kv_cache_layer must be"),
        ((query, cache, tables.t().contiguous().t(), lens), "block_tables' rows must be"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode_attention_cpu(*args, scale=0.1)


# ---- soft-capped logits (Gemma 2) and attention sinks (gpt-oss) ----------------------------
# (logit soft-cap, with sinks): a cap of 2 bends the logits of a scale of 0.5 (std >= 4) hard
EXTRAS = {"softcap": (2.0, False), "sinks": (None, True), "both": (2.0, True)}


def _torch_reference(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs = query.shape[0]
    metadata = AttentionMetadata(
        num_prefill_seqs=0,
        num_prefill_tokens=0,
        num_decode_seqs=num_seqs,
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),  # unused by forward
        prefill_query_start_loc=[0],
        prefill_seq_lens=[],
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_seq_lens=seq_lens,
        decode_block_tables=tables,
        max_decode_seq_len=int(seq_lens.max()),
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
    """Contexts of 1 to 90 tokens in blocks of 5; on one thread and three, to the bit."""
    softcap, with_sinks = EXTRAS[extras]
    rng = random.Random(head_dim)
    seq_lens = [1, 5, 21, 48, *(rng.randint(1, 90) for _ in range(6))]
    query, cache, tables, lens = _case(seq_lens, num_heads, num_kv_heads, head_dim, 5)
    generator = torch.Generator().manual_seed(num_heads)
    sinks = 2 * torch.randn(num_heads, generator=generator) + 1 if with_sinks else None
    case = (query, cache, tables, lens, 0.5)
    out = paged_decode_attention_cpu(*case, 1, sliding_window, softcap, sinks)
    assert torch.equal(out, paged_decode_attention_cpu(*case, 3, sliding_window, softcap, sinks))
    expected = _torch_reference(*case, sliding_window, softcap, sinks)
    torch.testing.assert_close(out, expected, **FLOAT32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 128), (6, 2, 48)])
def test_a_hard_biting_softcap_matches_a_float64_softmax(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Gemma 2's cap of 50 on logits of std 150 (three in four |logit| over 50, the largest over
    600): most are squeezed towards +-50, so the softmax spreads over the many near +50, where
    without the cap it picks out the largest; blocks of 16, so the cap runs on full vectors."""
    softcap = 50.0
    rng = random.Random(head_dim)
    seq_lens = [1, 16, 17, 64, *(rng.randint(1, 300) for _ in range(6))]
    query, cache, tables, lens = _case(seq_lens, num_heads, num_kv_heads, head_dim, 16)
    query *= 150.0  # scale * q . k: std 150, three times the cap
    case = (query, cache, tables, lens, head_dim**-0.5)
    out = paged_decode_attention_cpu(*case, 2, logit_softcap=softcap)
    expected = _expected(query, cache, tables, lens, logit_softcap=softcap)
    torch.testing.assert_close(out.double(), expected, **FLOAT32)
    torch.testing.assert_close(out, _torch_reference(*case, None, softcap, None), **FLOAT32)
    uncapped = _expected(query, cache, tables, lens)
    assert (uncapped - expected).abs().amax() > 1.0  # the cap bites: dropping it fails above


# the soft-cap's tanh, built as the kernels are, over n floats: y = tanh_poly(x), or libm's
TANH_HARNESS = """
#include <stdint.h>
#include "poly_math.h"
void tanh_poly_n(const float *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = tanh_poly(x[i]);
}
void tanhf_n(const float *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = tanhf(x[i]);
}
"""
# tanh_poly's max error over every float32 (an exhaustive C loop): 1.118e-7 from tanh, at
# x = +-0.8129; 1.788e-7 from glibc's tanhf (itself up to 1.04e-7 from tanh), at x = +-0.8411
TANH_POLY_MAX_ERROR, TANH_POLY_MAX_ERROR_FROM_TANHF = 1.12e-7, 1.8e-7


def test_the_softcap_tanh_is_within_its_stated_error_of_tanh(tmp_path: Path) -> None:
    """tanh_poly (poly_math.h, vectorised in the loop as in the kernels) on every 256th float32
    of [-20, 20], past which it is +-1 exactly, and densely where its error peaks (|x| in
    [0.8, 0.85]) and at its worst: within its measured max error of float64 tanh and of libm's
    tanhf; odd to the bit."""
    source, library = tmp_path / "tanh.c", tmp_path / "tanh.so"
    source.write_text(TANH_HARNESS)
    compiler = os.environ.get("CC", "cc")
    command = [compiler, *build.FLAGS, "-I", str(build.SOURCE_DIR), str(source), "-o"]
    subprocess.run([*command, str(library), "-lm"], check=True, capture_output=True)
    harness = ctypes.CDLL(str(library))
    positive = torch.arange(0, 0x41A00000, 256, dtype=torch.int32).view(torch.float32)
    peak = torch.linspace(0.8, 0.85, 100_001, dtype=torch.float32)
    worst = torch.tensor([0.812855601, 0.84105742])  # where the maxima above were measured
    x = torch.cat((positive, peak, worst, torch.tensor([20.5, 100.0, 1e30, float("inf")])))
    x = torch.cat((x, -x))
    results = {}
    for name in ("tanh_poly_n", "tanhf_n"):
        y = torch.empty_like(x)
        getattr(harness, name)(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(len(x))
        )
        results[name] = y
    poly = results["tanh_poly_n"].double()
    assert (poly - torch.tanh(x.double())).abs().max() <= TANH_POLY_MAX_ERROR
    assert (poly - results["tanhf_n"].double()).abs().max() <= TANH_POLY_MAX_ERROR_FROM_TANHF
    half = len(x) // 2
    assert torch.equal(poly[half:], -poly[:half])
    assert (poly[x.abs() >= 20].abs() == 1).all()


def test_bad_softcap_and_sinks_are_refused_by_name() -> None:
    query, cache, tables, lens = _case([20, 9], 4, 2, 64, 8)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"logit_softcap": 0.0}, "logit_softcap must be > 0 and finite, or None, got 0.0"),
        ({"logit_softcap": -1.0}, "logit_softcap must be > 0"),
        ({"sinks": torch.zeros(2)}, r"sinks must be a contiguous \[num_heads = 4\], got \(2,\)"),
        ({"sinks": torch.zeros(8)[::2]}, "sinks must be a contiguous"),
        ({"sinks": torch.zeros(4).half()}, "sinks must be float32, got torch.float16"),
        ({"sinks": torch.zeros(4, device="meta")}, "sinks is on meta"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode_attention_cpu(query, cache, tables, lens, 0.1, **kwargs)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache, and the loaders forgetting what they loaded (before and after)."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    build.load.cache_clear()
    kernel_module._kernel.cache_clear()
    yield tmp_path
    build.load.cache_clear()
    kernel_module._kernel.cache_clear()


def test_built_once_then_loaded_from_the_cache(fresh_build: Path) -> None:
    build.load("paged_decode_attention")
    (library,) = fresh_build.glob("paged_decode_attention-*.so")
    built_at = library.stat().st_mtime_ns
    build.load.cache_clear()
    kernel_module._kernel.cache_clear()
    query, cache, tables, lens = _case([5], 2, 2, 64, 4)
    paged_decode_attention_cpu(query, cache, tables, lens, 0.1)
    assert library.stat().st_mtime_ns == built_at  # found, not rebuilt
    assert [p.name for p in fresh_build.iterdir()] == [library.name]  # no partial files left


def test_a_changed_header_rebuilds_the_kernels_that_include_it(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = fresh_build / "sources"
    sources.mkdir()
    for name in ("paged_decode_attention.c", "poly_math.h", "kv_elements.h", "vec16.h"):
        (sources / name).write_bytes((build.SOURCE_DIR / name).read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    build.load("paged_decode_attention")
    with (sources / "poly_math.h").open("a") as header:
        header.write("/* changed */\n")
    build.load.cache_clear()
    build.load("paged_decode_attention")
    assert len(list(fresh_build.glob("paged_decode_attention-*.so"))) == 2


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="'cpu' is unavailable here: no C compiler .*no-such-cc"):
        resolve_attention_backend("cpu", cpu)


def test_a_failed_build_says_what_the_compiler_said(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that prints its version and fails
    with pytest.raises(build.KernelUnavailableError, match="building paged_decode_attention.c"):
        build.load("paged_decode_attention")
    assert list(fresh_build.iterdir()) == []


def test_a_compiler_without_openmp_builds_the_kernel_serial(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    no_openmp = fresh_build / "cc-without-openmp"
    no_openmp.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && echo "no OpenMP here" >&2 && exit 1; done\n'
        'exec cc "$@"\n'
    )
    no_openmp.chmod(0o755)
    monkeypatch.setenv("CC", str(no_openmp))
    query, cache, tables, lens = _case([30, 7, 50], 4, 2, 64, 8)
    out = paged_decode_attention_cpu(query, cache, tables, lens, 0.125, num_threads=2)
    torch.testing.assert_close(out.double(), _expected(query, cache, tables, lens), **FLOAT32)
    assert "without OpenMP" in caplog.text and "no OpenMP here" in caplog.text


# ---- quantized caches: float8 e4m3 and int8 elements, a K and a V scale per KV head ---------


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_quantized_cache_matches_a_float64_softmax_of_what_it_stores(
    kv_cache_dtype: str, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    """The scales applied to the logits and the output (not per element) keep float32's
    tolerance against a float64 softmax over the dequantized cache, whole contexts and
    sliding windows alike; head_dim 40 leaves a part-vector after the 16-element reads."""
    rng = random.Random(num_heads * 1000 + block_size * 10 + head_dim)
    seq_lens = [1, block_size, 3 * block_size, *(rng.randint(1, 90) for _ in range(9))]
    query, cache, tables, lens = _case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    stored, kv_scales, dequantized = stored_as(cache, kv_cache_dtype, head_dim)
    scale = head_dim**-0.5
    for window in (None, *_windows(block_size)):
        out = paged_decode_attention_cpu(
            query, stored, tables, lens, scale, sliding_window=window, kv_scales=kv_scales
        )
        expected = _expected(query, dequantized, tables, lens, window)
        torch.testing.assert_close(out.double(), expected, **FLOAT32)


@pytest.mark.parametrize("sliding_window", [None, 21], ids=["whole", "window-21"])
@pytest.mark.parametrize("extras", EXTRAS, ids=list(EXTRAS))
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_quantized_cache_with_softcap_and_sinks_matches_the_torch_reference(
    kv_cache_dtype: str, extras: str, sliding_window: int | None
) -> None:
    """GQA (8 heads over 2), contexts of 1 to 90 tokens in blocks of 5, against the torch
    reference reading the same quantized cache; on one thread and three, to the bit."""
    softcap, with_sinks = EXTRAS[extras]
    rng = random.Random(7)
    seq_lens = [1, 5, 21, 48, *(rng.randint(1, 90) for _ in range(6))]
    query, cache, tables, lens = _case(seq_lens, 8, 2, 64, 5)
    stored, kv_scales, _ = stored_as(cache, kv_cache_dtype, 7)
    generator = torch.Generator().manual_seed(8)
    sinks = 2 * torch.randn(8, generator=generator) + 1 if with_sinks else None
    case = (query, stored, tables, lens, 0.5)
    out = paged_decode_attention_cpu(*case, 1, sliding_window, softcap, sinks, kv_scales)
    shared = paged_decode_attention_cpu(*case, 3, sliding_window, softcap, sinks, kv_scales)
    assert torch.equal(out, shared)
    expected = _torch_reference(*case, sliding_window, softcap, sinks, kv_scales)
    torch.testing.assert_close(out, expected, **FLOAT32)


def test_bad_kv_scales_are_refused_by_name() -> None:
    query, cache, tables, lens = _case([20, 9], 4, 2, 64, 8)
    stored, kv_scales, _ = stored_as(cache, "int8", 0)
    cases: list[tuple[torch.Tensor, torch.Tensor | None, str]] = [
        (stored, None, "a torch.int8 kv_cache_layer needs kv_scales"),
        (cache, kv_scales, "kv_scales are for a quantized cache; kv_cache_layer is torch.float32"),
        (stored, kv_scales[:, :1], r"kv_scales must be a contiguous \[2, num_kv_heads = 2\]"),
        (stored, kv_scales.double(), "kv_scales must be float32"),
        (stored, kv_scales.to("meta"), "kv_scales is on meta, kv_cache_layer on cpu"),
        (stored.view(torch.uint8), kv_scales, "kv_cache_layer must be float32, bfloat16, float8"),
    ]
    for kv_cache_layer, scales, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode_attention_cpu(query, kv_cache_layer, tables, lens, 0.1, kv_scales=scales)
