"""The C K/V write kernel (engine/kernels/cpu/kv_cache_write.c): rows copied into a float32
cache; into a float8 e4m3 or int8 cache quantized bit for bit as ``quantize_kv`` stores them
(ties, subnormals, zeros of both signs, values past the type's range, NaN); and the kernels'
reading of a quantized element (kv_elements.h) as exactly the value torch reads, on the
vectorised float16 path and the portable one."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import build
from engine.kernels.cpu.kv_cache_write import write_kv_cache_cpu
from engine.kv_cache.kv_quantization import quantize_kv

QUANTIZED = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
# [K, V] x 4 KV heads: powers of two keep a tie a tie through the division, the others don't
SCALES = torch.tensor([[1.0, 0.125, 0.3, 7.0], [4.0, 0.5, 0.011, 1.3]])


def _strided_rows(num_tokens: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A [num_tokens, num_kv_heads, head_dim] view with each token's row inside a wider one,
    as K and V lie in a fused qkv projection's output."""
    return torch.zeros(num_tokens, 3 * num_kv_heads * head_dim)[:, : num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )


def _e4m3_magnitudes() -> torch.Tensor:  # every finite e4m3 magnitude, 0 to 448, ascending
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Values in stored units: exact ties of both types (every e4m3 midpoint, every half
    integer) and the floats either side of each, e4m3's subnormals and the ties between them,
    float32 subnormals, both zeros, values past +-448 and +-127, infinities (and NaN for e4m3,
    whose NaN torch defines)."""
    e4m3 = _e4m3_magnitudes()
    midpoints = (e4m3[1:] + e4m3[:-1]) / 2
    halves = torch.arange(-130, 131, dtype=torch.float32) + 0.5
    ties = torch.cat([midpoints, halves])
    subnormal_steps = torch.arange(0, 20, dtype=torch.float32) * 2.0**-10  # e4m3's are k * 2^-9
    magnitudes = torch.cat(
        [
            e4m3,
            ties,
            torch.nextafter(ties, torch.tensor(float("inf"))),
            torch.nextafter(ties, torch.tensor(0.0)),
            subnormal_steps,
            torch.tensor([1e-45, 1e-40, 1.1754942e-38, 127.0, 127.49, 128.0, 300.0]),
            torch.tensor([448.0, 449.0, 464.0, 465.0, 480.0, 1e9, 3e38, float("inf")]),
        ]
    )
    values = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, -0.0])])
    if dtype == torch.float8_e4m3fn:
        values = torch.cat([values, torch.tensor([float("nan"), -float("nan")])])
    return values


def _write(
    dtype: torch.dtype, key: torch.Tensor, value: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:  # [2, num_tokens, num_kv_heads, head_dim] as stored, by token
    num_tokens, num_kv_heads, head_dim = key.shape
    cache = torch.zeros(2, num_tokens, 1, num_kv_heads, head_dim, dtype=dtype)
    write_kv_cache_cpu(cache, key, value, torch.arange(num_tokens), scales)
    return cache[:, :, 0]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_hard_values_are_stored_as_quantize_kv_stores_them(kv_cache_dtype: str) -> None:
    """Each head's values are the hard values times its scale, so the power-of-two heads see
    the exact ties; K and V of a token by their own scales, from strided rows."""
    dtype = QUANTIZED[kv_cache_dtype]
    values = _hard_values(dtype)
    head_dim = 40
    num_tokens = -(-values.numel() // head_dim)
    units = torch.zeros(num_tokens * head_dim)
    units[: values.numel()] = values
    units = units.view(num_tokens, 1, head_dim)
    key, value = _strided_rows(num_tokens, 4, head_dim), _strided_rows(num_tokens, 4, head_dim)
    key.copy_(units * SCALES[0][:, None])
    value.copy_(units.flip(0) * SCALES[1][:, None])
    stored = _write(dtype, key, value, SCALES)
    for plane, rows in enumerate((key, value)):
        expected = quantize_kv(rows, SCALES[plane], dtype)
        assert torch.equal(stored[plane].view(torch.uint8), expected.view(torch.uint8))


def test_ties_round_to_even_and_ranges_clamp() -> None:
    """What the rules say, spelled out: int8 halves to the even integer, e4m3 midpoints to the
    even mantissa (subnormals too), both clamped; negative zero keeps its sign in e4m3."""
    key = torch.tensor([0.5, 1.5, 2.5, -2.5, 126.5, 127.5, -300.0, -0.0])
    int8 = _write(torch.int8, key.view(8, 1, 1), key.view(8, 1, 1), torch.ones(2, 1))
    assert int8[0].flatten().tolist() == [0, 2, 2, -2, 126, 127, -127, 0]
    key = torch.tensor([17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 2.0**-6 * 1.0625, 464.0, -1e9, -0.0])
    e4m3 = _write(torch.float8_e4m3fn, key.view(8, 1, 1), key.view(8, 1, 1), torch.ones(2, 1))
    expected = [16.0, 20.0, 0.0, 2.0**-8, 2.0**-6, 448.0, -448.0, -0.0]
    assert e4m3[0].flatten().float().tolist() == expected
    assert e4m3[0].flatten().view(torch.uint8)[-1] == 0x80  # negative zero


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_sweep_of_float32_is_stored_as_quantize_kv_stores_it(kv_cache_dtype: str) -> None:
    """Every 4099th float32 bit pattern (about a million, every exponent and sign), by a scale
    of 1 and by scales that are not powers of two."""
    dtype = QUANTIZED[kv_cache_dtype]
    bits = torch.arange(0, 2**32, 4099, dtype=torch.int64)
    values = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    if dtype == torch.int8:
        values = values[~values.isnan()]  # torch's NaN to int8 is the C++ cast's, unspecified
    head_dim = 64
    num_tokens = values.numel() // (4 * head_dim)
    rows = values[: num_tokens * 4 * head_dim].view(num_tokens, 4, head_dim)
    for scales in (torch.ones(2, 4), SCALES):
        stored = _write(dtype, rows, rows, scales)
        for plane in (0, 1):
            expected = quantize_kv(rows, scales[plane], dtype)
            assert torch.equal(stored[plane].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_quantized_rows_land_in_their_slots(kv_cache_dtype: str) -> None:
    """Padding slots (-1) are skipped and every slot not written keeps its bytes; a slot past
    the cache is refused by name, the tokens before it written."""
    dtype = QUANTIZED[kv_cache_dtype]
    generator = torch.Generator().manual_seed(3)
    key = _strided_rows(4, 2, 8)
    value = _strided_rows(4, 2, 8)
    key.copy_(torch.randn(4, 2, 8, generator=generator))
    value.copy_(torch.randn(4, 2, 8, generator=generator))
    scales = torch.tensor([[0.02, 0.05], [0.03, 0.01]])
    cache = torch.full((2, 4, 3, 2, 8), 0x55, dtype=torch.uint8).view(dtype)
    write_kv_cache_cpu(cache, key, value, torch.tensor([11, 0, -1, 4]), scales)
    slots = cache.view(torch.uint8).view(2, 12, 2, 8)
    for token, slot in ((0, 11), (1, 0), (3, 4)):
        for plane, rows in enumerate((key, value)):
            expected = quantize_kv(rows[token : token + 1], scales[plane], dtype)
            assert torch.equal(slots[plane, slot], expected.view(torch.uint8)[0])
    untouched = [slot for slot in range(12) if slot not in (11, 0, 4)]
    assert (slots[:, untouched] == 0x55).all()
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 12 is past the cache's 12 slots"):
        write_kv_cache_cpu(cache, key[:2], value[:2], torch.tensor([2, 12]), scales)
    assert torch.equal(slots[0, 2], quantize_kv(key[:1], scales[0], dtype).view(torch.uint8)[0])


def test_bad_scales_and_caches_are_refused_by_name() -> None:
    key = torch.randn(2, 2, 8)
    slots = torch.tensor([0, 1])
    int8_cache = torch.zeros(2, 2, 2, 2, 8, dtype=torch.int8)
    cases = [
        (int8_cache, None, "a torch.int8 kv_cache_layer needs kv_scales"),
        (torch.zeros(2, 2, 2, 2, 8), torch.ones(2, 2), "kv_scales are for a quantized cache"),
        (int8_cache, torch.ones(2, 3), r"kv_scales must be a contiguous \[2, num_kv_heads = 2\]"),
        (int8_cache, torch.ones(2, 4)[:, ::2], "kv_scales must be a contiguous"),
        (int8_cache, torch.ones(2, 2).double(), "kv_scales must be float32, got torch.float64"),
        (
            torch.zeros(2, 2, 2, 2, 8, dtype=torch.float16),
            None,
            "kv_cache_layer must be float32, bfloat16, float8_e4m3fn or int8, got torch.float16",
        ),
    ]
    for cache, scales, message in cases:
        with pytest.raises(ValueError, match=message):
            write_kv_cache_cpu(cache, key, key, slots, scales)
    with pytest.raises(ValueError, match="key must be float32"):
        write_kv_cache_cpu(int8_cache, key.half(), key, slots, torch.ones(2, 2))


def test_float32_rows_land_in_their_slots() -> None:
    """New K/V straight from a qkv projection's output (strided rows) into the paged cache;
    padding slots (-1) are skipped, a slot past the cache is refused by name."""
    torch.manual_seed(5)
    num_kv_heads, head_dim = 2, 8
    cache = torch.zeros(2, 4, 3, num_kv_heads, head_dim)
    qkv = torch.randn(4, (4 + 2 * num_kv_heads) * head_dim)
    _, key, value = qkv.split([4 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    key = key.view(4, num_kv_heads, head_dim)
    value = value.view(4, num_kv_heads, head_dim)
    write_kv_cache_cpu(cache, key, value, torch.tensor([11, 0, -1, 4]))
    torch.testing.assert_close(cache[0, 3, 2], key[0])
    torch.testing.assert_close(cache[1, 0, 0], value[1])
    torch.testing.assert_close(cache[0, 1, 1], key[3])
    assert int((cache != 0).any(dim=(-1, -2)).sum()) == 6  # 3 slots, K and V; -1 skipped
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 12 is past the cache's 12 slots"):
        write_kv_cache_cpu(cache, key[:2], value[:2], torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="key must be"):
        write_kv_cache_cpu(cache, key[:, :1], value, torch.tensor([0, 1, 2, 3]))


# how the attention kernels read a quantized row, built as they are (and on the portable path)
READ_HARNESS = """
#include "kv_elements.h"
void read_row(const void *row, float *out, int64_t n, int64_t kind) {
    kv_row_as_floats(row, out, n, (int)kind);
}
"""


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_every_stored_byte_reads_as_torch_reads_it(tmp_path: Path, portable: bool) -> None:
    """All 256 bytes as e4m3 and as int8, in rows of 256 and of 250 (the vectorised float16
    path takes 16 at a time, the rest element by element): the very float torch makes of each
    (negative zero included), NaN where torch has NaN."""
    source, library = tmp_path / "read.c", tmp_path / "read.so"
    source.write_text(READ_HARNESS)
    compiler = os.environ.get("CC", "cc")
    defines = ["-DPDSERVE_PORTABLE_E4M3"] if portable else []
    command = [compiler, *build.FLAGS, *defines, "-I", str(build.SOURCE_DIR), str(source), "-o"]
    subprocess.run([*command, str(library), "-lm"], check=True, capture_output=True)
    read_row = ctypes.CDLL(str(library)).read_row
    read_row.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype, code in ((torch.float8_e4m3fn, 1), (torch.int8, 2)):
        for n in (256, 250):
            row = every_byte[-n:].clone()
            out = torch.empty(n)
            read_row(row.data_ptr(), out.data_ptr(), n, code)
            expected = row.view(dtype).float()
            assert torch.equal(out.isnan(), expected.isnan())
            numbers = ~expected.isnan()
            assert torch.equal(out[numbers].view(torch.int32), expected[numbers].view(torch.int32))
