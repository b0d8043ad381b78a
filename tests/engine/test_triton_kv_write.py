"""The Triton KV-cache write kernel vs ``index_copy_`` and the torch backend, on random inputs.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.kv_cache_write import write_kv_cache

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
