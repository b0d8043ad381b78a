"""The block-copy kernel (what a `cuda_ipc` receiver runs) against torch indexing, on random
caches. Without CUDA it runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
with one, at Llama-3-8B's plane size too."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.block_copy import TILE_BYTES, _as_words, copy_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _planes(num_planes: int, num_blocks: int, numel: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_planes, num_blocks, numel, generator=generator).to(dtype)
    values[values == 0] = 1.0  # an unwritten block shows
    return values.to(DEVICE)


def _ids(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _expected(src, src_ids: list[int], dst, dst_ids: list[int]) -> torch.Tensor:
    expected = dst.clone()
    expected[:, dst_ids] = src[:, src_ids]
    return expected


@pytest.mark.parametrize(
    ("numel", "dtype", "src_ids", "dst_ids"),
    [
        (64, torch.float32, [3, 4, 5, 6], [0, 1, 2, 3]),  # runs on both sides
        (96, torch.bfloat16, [7, 0, 5], [9, 2, 4]),  # scattered, out of order
        (40, torch.float16, [1], [11]),  # one block; 80 B planes: 8-byte words x 10
        (6, torch.float16, [2, 6, 4], [5, 3, 0]),  # 12 B planes: 4-byte words
        (3, torch.bfloat16, [0, 7], [1, 10]),  # 6 B planes: 2-byte words
        (TILE_BYTES // 4 + 5, torch.float32, [6, 2], [8, 0]),  # a plane over one tile
    ],
)
def test_copies_each_block_to_its_own_id(
    numel: int, dtype: torch.dtype, src_ids: list[int], dst_ids: list[int]
) -> None:
    src = _planes(4, 8, numel, dtype, seed=1)
    dst = _planes(4, 12, numel, dtype, seed=2)
    expected = _expected(src, src_ids, dst, dst_ids)
    before = src.clone()
    copy_blocks(src, _ids(src_ids), dst, _ids(dst_ids, torch.int32))
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(src, before)


def test_a_cache_that_starts_off_a_word_boundary_is_copied_in_narrower_words() -> None:
    storage = _planes(1, 1, 2 * 3 * 8 + 1, torch.float16, seed=3).view(-1)
    src = storage[1:].view(2, 3, 8)  # starts 2 bytes into its storage: 2-byte words
    dst = _planes(2, 5, 8, torch.float16, seed=4)
    assert _as_words(src).dtype == torch.int16 and _as_words(dst).dtype == torch.int64
    expected = _expected(src, [2, 0], dst, [4, 1])
    copy_blocks(src, _ids([2, 0]), dst, _ids([4, 1]))
    assert torch.equal(dst, expected)


def test_nothing_to_copy_is_a_no_op() -> None:
    src, dst = _planes(2, 3, 8, torch.float32, 5), _planes(2, 3, 8, torch.float32, 6)
    before = dst.clone()
    copy_blocks(src, _ids([]), dst, _ids([]))
    assert torch.equal(dst, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_full_size_llama_planes_on_the_gpu() -> None:
    # Llama-3-8B, 16-token blocks: 64 planes of 16 x 8 x 128 bf16 (32 KiB)
    src = _planes(64, 600, 16 * 8 * 128, torch.bfloat16, seed=7)
    dst = _planes(64, 700, 16 * 8 * 128, torch.bfloat16, seed=8)
    generator = torch.Generator().manual_seed(9)
    src_ids = torch.randperm(600, generator=generator)[:512].tolist()
    dst_ids = torch.randperm(700, generator=generator)[:512].tolist()
    expected = _expected(src, src_ids, dst, dst_ids)
    copy_blocks(src, _ids(src_ids), dst, _ids(dst_ids))
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "dst": a["dst"].to(torch.float16)}, "dst dtype"),
        (lambda a: {**a, "dst": a["dst"][:, :, :4].contiguous()}, "dst's planes"),
        (lambda a: {**a, "dst": a["dst"][:1]}, "dst's planes"),
        (lambda a: {**a, "src": a["src"][0]}, "src must be"),
        (lambda a: {**a, "src": a["src"].transpose(0, 1)}, "src must be contiguous"),
        (lambda a: {**a, "dst_ids": a["dst_ids"][:1]}, "src_ids has 2 blocks, dst_ids 1"),
        (lambda a: {**a, "src_ids": a["src_ids"].float()}, "src_ids must be int64"),
        (lambda a: {**a, "dst_ids": a["dst_ids"].view(2, 1)}, "dst_ids must be one-dim"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, message: str) -> None:
    arguments = {
        "src": _planes(2, 4, 8, torch.float32, 1),
        "src_ids": _ids([0, 1]),
        "dst": _planes(2, 4, 8, torch.float32, 2),
        "dst_ids": _ids([2, 3]),
    }
    with pytest.raises(ValueError, match=message):
        copy_blocks(**change(arguments))
