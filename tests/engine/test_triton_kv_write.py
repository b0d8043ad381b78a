"""The Triton KV-cache write kernel vs ``index_copy_`` and the torch backend, on random inputs;
into a quantized cache, to the bit vs ``quantize_kv`` on values that probe its rounding.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.kv_cache_write import write_kv_cache
from engine.kv_cache.kv_quantization import quantize_kv, storage_dtype

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(generator: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


def _inputs(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache, random K/V and distinct random slots."""
    generator = torch.Generator().manual_seed(seed)
    cache = _randn(generator, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    key = _randn(generator, num_tokens, num_kv_heads, head_dim, dtype=dtype)
    value = _randn(generator, num_tokens, num_kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    return cache, key, value, slots.to(DEVICE)  # slots: [num_tokens] int64


def _reference_write(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    expected = cache.clone()
    keep = slots >= 0
    flat = expected.view(2, -1, *cache.shape[3:])  # [2, num_slots, num_kv_heads, head_dim]
    flat[0, slots[keep]] = key[keep]
    flat[1, slots[keep]] = value[keep]
    return expected


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "num_kv_heads", "head_dim", "dtype"),
    [
        (1, 8, 2, 64, torch.float32),
        (13, 4, 1, 128, torch.float32),
        (20, 16, 4, 64, torch.bfloat16),
        (9, 8, 3, 24, torch.float16),  # neither count a power of two
    ],
)
def test_matches_torch_backend(
    num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    cache, key, value, slots = _inputs(num_tokens, 6, block_size, num_kv_heads, head_dim, dtype)
    expected = cache.clone()
    TorchAttentionBackend().write_kv(expected, key, value, slots)
    write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache, expected)


def test_negative_slots_are_skipped() -> None:
    cache, key, value, slots = _inputs(10, 4, 8, 2, 64, seed=1)
    slots[[0, 4, 9]] = -1  # padding tokens
    before = cache.clone()
    expected = _reference_write(cache, key, value, slots)
    write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache, expected)
    # only the 7 real tokens' slots changed
    changed = (cache != before).any(0).flatten(2).any(-1).flatten()  # [num_slots]
    assert int(changed.sum()) == 7


def test_strided_key_value_and_int32_slots() -> None:
    """K and V as views of one fused [num_tokens, 2, num_kv_heads, head_dim] projection."""
    cache, _, _, slots = _inputs(7, 4, 8, 2, 64, seed=2)
    generator = torch.Generator().manual_seed(3)
    fused = _randn(generator, 7, 2, 2, 64, dtype=torch.float32)
    key, value = fused[:, 0], fused[:, 1]
    assert not key.is_contiguous()
    expected = _reference_write(cache, key, value, slots)
    write_kv_cache(cache, key, value, slots.to(torch.int32))
    assert torch.equal(cache, expected)


def test_no_tokens_is_a_no_op() -> None:
    cache, key, value, slots = _inputs(0, 2, 4, 2, 64)
    before = cache.clone()
    write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache, before)


@pytest.mark.skipif(DEVICE == "cuda", reason="checked on the host only (a GPU would sync)")
def test_a_slot_past_the_cache_is_refused_and_nothing_is_written() -> None:
    """Slot num_slots wrote K into V's slot 0 (the torch backend raises IndexError there)."""
    cache, key, value, slots = _inputs(4, 2, 8, 2, 64)
    before = cache.clone()
    slots[2] = 2 * 8
    with pytest.raises(ValueError, match="slot_mapping must be < num_blocks \\* block_size = 16"):
        write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache, before)


def _bad_args(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cache, key, value, slots = _inputs(4, 2, 8, 2, 64)
    if case == "cache_shape":
        cache = cache[0]
    elif case == "cache_strides":
        cache = cache.transpose(3, 4)
    elif case == "key_shape":
        key = key[:, :1]
    elif case == "value_dtype":
        value = value.double()
    elif case == "key_strides":
        key = key.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "slot_count":
        slots = slots[:3]
    elif case == "slot_dtype":
        slots = slots.float()
    elif case == "slot_device":
        slots = torch.empty(4, dtype=torch.int64, device="meta")
    return cache, key, value, slots


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("cache_shape", "kv_cache_layer must be"),
        ("cache_strides", "kv_cache_layer must be contiguous"),
        ("key_shape", "key must be"),
        ("value_dtype", "value dtype"),
        ("key_strides", "key must be contiguous in head_dim"),
        ("slot_count", "slot_mapping must be"),
        ("slot_dtype", "slot_mapping must be int64"),
        ("slot_device", "slot_mapping is on meta"),
    ],
)
def test_bad_arguments_name_the_argument(case: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_kv_cache(*_bad_args(case))


# ---- a quantized cache: float8 e4m3 or int8 elements, a K and a V scale per head -----------
def _rounding_probes(kv_cache_dtype: str) -> torch.Tensor:  # [num_values] float32
    """Values that probe the rounding: every float8 e4m3 value, the midpoints between
    neighbours (ties, subnormal ones included) and the floats either side of each; or every
    half integer around int8's range and the floats either side; then zeros of both signs,
    values past the largest stored magnitude, infinities, float32 subnormals and randoms."""
    if kv_cache_dtype == "fp8_e4m3":
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        grid = codes.float()
        grid = grid[~grid.isnan()].unique()  # sorted, -448 .. 448
        ties = (grid[1:] + grid[:-1]) / 2
        large = [448.0, 456.0, 464.0, 479.0, 480.0, 1e6]
    else:
        grid = torch.arange(-130.0, 131.0)
        ties = grid[:-1] + 0.5
        large = [127.0, 127.49, 127.5, 128.0, 1000.0]
    probes = [
        grid,
        ties,
        torch.nextafter(ties, torch.tensor(float("inf"))),
        torch.nextafter(ties, torch.tensor(float("-inf"))),
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 1e-30]),
        torch.tensor(large),
        -torch.tensor(large),
        torch.randn(500, generator=torch.Generator().manual_seed(7)) * 100,
    ]
    return torch.cat(probes)


def _quantized_inputs(
    values: torch.Tensor, dtype: torch.dtype, kv_cache_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``values`` (padded with zeros) as every head's K and, negated and reversed, V over 3 KV
    heads of 32; a cache of random bytes with room to spare, distinct random slots, and the
    scales: 1 and a power of two keep ties ties, the third rounds in the division."""
    head_dim, num_kv_heads = 32, 3
    num_tokens = -(-values.numel() // head_dim)
    padded = torch.zeros(num_tokens * head_dim)
    padded[: values.numel()] = values
    key = padded.view(num_tokens, 1, head_dim).expand(-1, num_kv_heads, -1).to(dtype)
    value = (-padded.flip(0)).view(num_tokens, 1, head_dim).expand(-1, num_kv_heads, -1)
    key, value = key.contiguous().to(DEVICE), value.contiguous().to(dtype=dtype, device=DEVICE)
    generator = torch.Generator().manual_seed(1)
    num_slots = num_tokens + 9
    cache_bytes = torch.randint(
        0, 256, (2, num_slots, 1, num_kv_heads, head_dim), generator=generator
    )
    cache_dtype = storage_dtype(kv_cache_dtype, dtype)
    cache = cache_bytes.to(torch.uint8).view(cache_dtype).to(DEVICE)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens].to(DEVICE)
    scales = torch.tensor([[1.0, 0.25, 0.37], [1.0, 2.0, 3.3]], device=DEVICE)
    return cache, key, value, slots, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_write_is_bit_exact(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """Every stored byte is quantize_kv's (the torch backend's write): ties to even, clamped at
    448 / 127, e4m3 subnormals, negative zero, infinities saturated; other slots untouched."""
    cache, key, value, slots, scales = _quantized_inputs(
        _rounding_probes(kv_cache_dtype), dtype, kv_cache_dtype
    )
    expected = cache.clone()
    TorchAttentionBackend().write_kv(expected, key, value, slots, scales)
    write_kv_cache(cache, key, value, slots, scales)
    mismatched = cache.view(torch.uint8) != expected.view(torch.uint8)
    assert not mismatched.any(), (
        cache[mismatched][:8].float().tolist(),
        expected[mismatched][:8].float().tolist(),
    )


@pytest.mark.parametrize(
    ("kv_cache_dtype", "stored"),
    [
        # 1 + 1/16 ties to 1, 1 + 3/16 to 1.25; 464 (448 and 480's tie) and inf saturate at 448;
        # 3 * 2^-10 ties to the even subnormal 2^-8; a value under 2^-10 to zero, keeping its sign
        ("fp8_e4m3", [1.0, 1.25, 448.0, -448.0, 448.0, 2**-8, -0.0, float("nan")]),
        ("int8", [2.0, -2.0, 4.0, 127.0, -127.0, 127.0, 0.0, 0.0]),  # (no -0 in int8)
    ],
)
def test_quantized_write_rounds_by_the_rules(kv_cache_dtype: str, stored: list[float]) -> None:
    """The rules by hand, K by a scale of 1 (V by 2: the same values halved) on one head:
    float8 e4m3 rounds to nearest even and saturates at 448, int8 rounds half to even and
    clamps at 127; NaN stays NaN in float8 and is 0 in int8."""
    if kv_cache_dtype == "fp8_e4m3":
        key = [1.0625, 1.1875, 464.0, -1e6, float("inf"), 3 * 2**-10, -(2**-11), float("nan")]
    else:
        key = [2.5, -2.5, 3.5, 127.5, -300.0, float("inf"), -0.4, float("nan")]
    dtype = storage_dtype(kv_cache_dtype, torch.float32)
    cache = torch.zeros(2, 1, 1, 1, 8, dtype=dtype, device=DEVICE)
    key_tensor = torch.tensor(key, device=DEVICE).view(1, 1, 8)
    scales = torch.tensor([[1.0], [0.5]], device=DEVICE)
    slot = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    write_kv_cache(cache, key_tensor, key_tensor / 2, slot, scales)
    for plane in (0, 1):
        got = cache[plane].flatten().float()
        torch.testing.assert_close(got, torch.tensor(stored, device=DEVICE), equal_nan=True)
        assert got.signbit().tolist() == torch.tensor(stored).signbit().tolist()


def test_quantized_write_skips_padding_slots() -> None:
    """Padding tokens' (slot -1) K/V are dropped, the others' stored as quantize_kv stores them."""
    cache, key, value, slots = _inputs(10, 4, 8, 2, 64, seed=4)
    cache = cache.to(torch.float8_e4m3fn)
    slots[[1, 6]] = -1
    scales = torch.tensor([[0.5, 0.02], [0.1, 1.0]], device=DEVICE)
    before = cache.clone()
    write_kv_cache(cache, key, value, slots, scales)
    keep = slots >= 0
    flat, flat_before = cache.view(torch.uint8), before.view(torch.uint8)
    changed = (flat != flat_before).flatten(3).any(-1).any(0).flatten()  # [num_slots]
    assert changed.nonzero().flatten().tolist() == sorted(slots[keep].tolist())
    stored = cache.view(2, -1, 2, 64)[:, slots[keep]]
    assert torch.equal(
        stored[0].view(torch.uint8),
        quantize_kv(key[keep], scales[0], cache.dtype).view(torch.uint8),
    )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_scales", "a torch.int8 kv_cache_layer needs kv_scales"),
        ("scales_for_float", "kv_scales are for a quantized cache"),
        ("scales_shape", r"kv_scales must be a contiguous \[2, num_kv_heads = 2\], got \(2, 3\)"),
        ("scales_dtype", "kv_scales must be float32, got torch.float64"),
        ("key_dtype", "key dtype must be float32, float16 or bfloat16, got torch.int8"),
    ],
)
def test_bad_quantized_arguments_name_the_argument(case: str, message: str) -> None:
    cache, key, value, slots = _inputs(4, 2, 8, 2, 64)
    scales: torch.Tensor | None = torch.ones(2, 2, device=DEVICE)
    quantized = cache.to(torch.int8)
    if case == "no_scales":
        scales = None
    elif case == "scales_for_float":
        quantized = cache
    elif case == "scales_shape":
        scales = torch.ones(2, 3, device=DEVICE)
    elif case == "scales_dtype":
        scales = torch.ones(2, 2, dtype=torch.float64, device=DEVICE)
    elif case == "key_dtype":
        key = key.to(torch.int8)
    with pytest.raises(ValueError, match=message):
        write_kv_cache(quantized, key, value, slots, scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_write_is_bit_exact_on_gpu(kv_cache_dtype: str) -> None:
    """The compiled kernel (its IEEE division, integer rounding and stores) vs quantize_kv on
    the GPU, on the rounding probes and on full-size random bf16 K/V with padding slots."""
    probes = _rounding_probes(kv_cache_dtype)
    for dtype in (torch.float32, torch.bfloat16):
        cache, key, value, slots, scales = _quantized_inputs(probes, dtype, kv_cache_dtype)
        expected = cache.clone()
        TorchAttentionBackend().write_kv(expected, key, value, slots, scales)
        write_kv_cache(cache, key, value, slots, scales)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8)), dtype
    num_tokens, block_size = 16 * 1024, 16
    cache, key, value, slots = _inputs(
        num_tokens, 2 * num_tokens // block_size, block_size, 8, 128, torch.bfloat16
    )
    cache = cache.to(storage_dtype(kv_cache_dtype, torch.bfloat16))
    slots[::97] = -1
    scales = torch.rand(2, 8, device=DEVICE) * 0.05 + 0.005  # some heads clamp
    keep = slots >= 0
    expected = cache.clone()
    TorchAttentionBackend().write_kv(expected, key[keep], value[keep], slots[keep], scales)
    write_kv_cache(cache, key, value, slots, scales)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_size_on_gpu() -> None:
    """64 seqs of 1k tokens, bf16, 8 KV heads of 128, with some padding slots."""
    num_tokens, block_size = 64 * 1024, 16
    cache, key, value, slots = _inputs(
        num_tokens, 2 * num_tokens // block_size, block_size, 8, 128, torch.bfloat16
    )
    slots[::97] = -1
    expected = _reference_write(cache, key, value, slots)
    write_kv_cache(cache, key, value, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)
