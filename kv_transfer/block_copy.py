"""Triton kernel: copy KV blocks from one cache into another, each to its own block id.

``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` for every pair ``i``, where both caches are seen as
planes ``[num_planes, num_blocks, plane_numel]`` (`chunking.planes_view`). One kernel reads each
byte once and writes it once: what a device-to-device copy of the same bytes costs, where
``index_select`` + ``index_copy_`` (or a gather into a staging buffer and a scatter out of it)
moves every byte twice. The `cuda_ipc` receiver runs it with ``src`` the sender's cache, mapped.

Programs: grid ``(num_pairs, num_planes, tiles per plane)``; each moves one tile of one plane of
one block pair. The planes are moved as the widest integer words their byte size and addresses
allow (8, 4, 2 or 1 bytes), so the kernel is the same for every KV dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_BYTES = 8192  # bytes one program moves: 16 B per thread per load at 4 warps, x4
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third dimensions
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _copy_blocks_kernel(
    src_ptr,  # [num_planes, src_blocks, words_per_plane], contiguous
    dst_ptr,  # [num_planes, dst_blocks, words_per_plane], contiguous
    src_ids_ptr,  # [num_pairs]
    dst_ids_ptr,  # [num_pairs]
    src_blocks,  # blocks in the source cache (its plane stride / WORDS)
    dst_blocks,  # blocks in the destination cache
    WORDS: tl.constexpr,  # words in one plane of one block
    TILE: tl.constexpr,  # words one program moves
):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    words = tile * TILE + tl.arange(0, TILE)
    mask = words < WORDS
    src = src_ptr + (plane * src_blocks + src_block) * WORDS + words
    dst = dst_ptr + (plane * dst_blocks + dst_block) * WORDS + words
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def copy_blocks(
    src: torch.Tensor,  # [num_planes, src_blocks, plane_numel]
    src_ids: torch.Tensor,  # [num_pairs] int64 or int32, < src_blocks
    dst: torch.Tensor,  # [num_planes, dst_blocks, plane_numel], src's dtype
    dst_ids: torch.Tensor,  # [num_pairs], < dst_blocks
) -> None:
    """Copy block ``src_ids[i]`` of ``src`` into block ``dst_ids[i]`` of ``dst`` (every plane),
    on the current stream. The ids are not range-checked here (that would sync on a GPU): the
    callers check them on the host, where they come from.

    Raises ValueError naming the argument on a wrong shape, dtype, device or layout.
    """
    _check_args(src, src_ids, dst, dst_ids)
    num_pairs, (num_planes, src_blocks, _), dst_blocks = len(src_ids), src.shape, dst.shape[1]
    if num_pairs == 0 or src.numel() == 0:
        return
    word = min(_word_size(src), _word_size(dst))  # the less aligned one's words, for both
    src_words, dst_words = _as_words(src, word), _as_words(dst, word)
    words = src_words.shape[2]
    tile = min(TILE_BYTES // src_words.dtype.itemsize, triton.next_power_of_2(words))
    _copy_blocks_kernel[(num_pairs, num_planes, triton.cdiv(words, tile))](
        src_words,
        dst_words,
        src_ids,
        dst_ids,
        src_blocks,
        dst_blocks,
        WORDS=words,
        TILE=tile,
    )


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_size(planes: torch.Tensor) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides a plane's bytes and the tensor's start
    (its address, and its offset into its storage, which is what ``Tensor.view(dtype)`` checks)."""
    plane_nbytes = planes.shape[2] * planes.element_size()
    starts = (planes.data_ptr(), planes.storage_offset() * planes.element_size())
    return next(
        size
        for size in _WORD_DTYPES
        if plane_nbytes % size == 0 and all(start % size == 0 for start in starts)
    )


def _as_words(planes: torch.Tensor, widest: int = 8) -> torch.Tensor:
    """``planes`` as ``[num_planes, num_blocks, words]`` of the widest integer word of at most
    ``widest`` bytes that `_word_size` allows (a narrower power of two divides too)."""
    return planes.view(torch.uint8).view(_WORD_DTYPES[min(widest, _word_size(planes))])


def _check_args(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    for name, planes in (("src", src), ("dst", dst)):
        _require(
            planes.dim() == 3,
            f"{name} must be [num_planes, num_blocks, plane_numel], got {tuple(planes.shape)}",
        )
        _require(planes.is_contiguous(), f"{name} must be contiguous")
    _require(src.dtype == dst.dtype, f"dst dtype {dst.dtype} != src dtype {src.dtype}")
    _require(
        src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2],
        f"dst's planes {tuple(dst.shape[::2])} differ from src's {tuple(src.shape[::2])} "
        "(num_planes, plane_numel)",
    )
    _require(src.shape[0] <= _MAX_GRID_YZ, f"src has {src.shape[0]} planes, over {_MAX_GRID_YZ}")
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        _require(ids.dim() == 1, f"{name} must be one-dimensional, got {tuple(ids.shape)}")
        _require(ids.dtype in _INDEX_DTYPES, f"{name} must be int64 or int32, got {ids.dtype}")
        _require(ids.is_contiguous(), f"{name} must be contiguous")
    _require(
        len(src_ids) == len(dst_ids),
        f"src_ids has {len(src_ids)} blocks, dst_ids {len(dst_ids)}",
    )
    for name, tensor in (("src", src), ("src_ids", src_ids), ("dst_ids", dst_ids)):
        _require(tensor.device == dst.device, f"{name} is on {tensor.device}, dst on {dst.device}")
    _require(
        dst.device.type != "cpu" or bool(triton.knobs.runtime.interpret),
        "copy_blocks is a Triton kernel: it needs a GPU (CPU tensors only run with "
        "TRITON_INTERPRET=1)",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
