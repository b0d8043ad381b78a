"""Cutting a transfer into chunks that fit a staging slot, and copying chunks in and out.

A transfer of `n` blocks is the tensor `heads[:, block_ids]` of shape
`[num_planes, n, block_size, num_moved_heads, head_dim]` (planes = K and V of every layer;
`heads_view`: the moved heads of each plane, all of it when the channel moves the whole cache).
A chunk is a rectangle of it: a range of planes × a range of positions in the block list,
gathered into (or scattered from) one contiguous staging buffer. Both ends compute the same plan
from the layout (the moved heads only), the block count and the agreed chunk size, so chunk k
means the same bytes on both sides, whichever heads of its own cache each end holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_transfer.layout import KVCacheLayout


@dataclass(frozen=True, slots=True)
class Chunk:
    plane_start: int  # first plane (layer * 2 + k_or_v)
    plane_stop: int  # one past the last plane
    block_start: int  # first position in the transfer's block list
    block_stop: int  # one past the last position
    nbytes: int  # bytes of the gathered rectangle


def plan_chunks(layout: KVCacheLayout, num_blocks: int, max_chunk_bytes: int) -> list[Chunk]:
    """Chunks of at most `max_chunk_bytes` covering the moved heads of every plane of every
    block, in order."""
    plane_nbytes = layout.moved_plane_nbytes
    if max_chunk_bytes < plane_nbytes:
        raise ValueError(
            f"chunk size {max_chunk_bytes} B is smaller than one plane ({plane_nbytes} B)"
        )
    num_planes = layout.num_planes
    blocks_per_chunk = max_chunk_bytes // layout.moved_block_nbytes
    if blocks_per_chunk >= 1:  # whole blocks (all planes) per chunk
        return [
            Chunk(
                0,
                num_planes,
                b,
                min(b + blocks_per_chunk, num_blocks),
                num_planes * (min(b + blocks_per_chunk, num_blocks) - b) * plane_nbytes,
            )
            for b in range(0, num_blocks, blocks_per_chunk)
        ]
    planes_per_chunk = max_chunk_bytes // plane_nbytes  # one block, a range of planes
    return [
        Chunk(
            p,
            min(p + planes_per_chunk, num_planes),
            b,
            b + 1,
            (min(p + planes_per_chunk, num_planes) - p) * plane_nbytes,
        )
        for b in range(num_blocks)
        for p in range(0, num_planes, planes_per_chunk)
    ]


def planes_view(kv_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """`[num_planes, num_cache_blocks, plane_numel]` view of a contiguous cache."""
    return kv_cache.view(layout.num_planes, kv_cache.shape[2], layout.plane_numel)


def heads_view(kv_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """The moved heads of a contiguous cache, as
    `[num_planes, num_cache_blocks, block_size, num_moved_heads, head_dim]`: a view, strided
    when the channel moves some of the cache's heads, contiguous when it moves all of them."""
    first = layout.moved_first
    planes = kv_cache.view(
        layout.num_planes, kv_cache.shape[2], layout.block_size, layout.num_kv_heads, -1
    )  # [num_planes, num_cache_blocks, block_size, num_kv_heads, head_dim]
    return planes[:, :, :, first : first + layout.num_moved_heads]


def chunk_view(staging: torch.Tensor, chunk: Chunk, layout: KVCacheLayout) -> torch.Tensor:
    """The first `chunk.nbytes` of a uint8 staging buffer, as the chunk's typed rectangle."""
    shape = (
        chunk.plane_stop - chunk.plane_start,
        chunk.block_stop - chunk.block_start,
        layout.block_size,
        layout.num_moved_heads,
        layout.head_dim,
    )  # [planes, blocks, block_size, num_moved_heads, head_dim]
    return staging[: chunk.nbytes].view(layout.torch_dtype).view(shape)


class BlockIds:
    """A transfer's block ids, as Python ints (CPU scatters, the wire) and as an index tensor
    on the cache's device (gathers, GPU scatters)."""

    def __init__(self, values: tuple[int, ...], device: torch.device) -> None:
        self.values = values
        self.device = device
        self._tensor: torch.Tensor | None = None

    @classmethod
    def build(
        cls, block_ids: Sequence[int], num_cache_blocks: int, device: torch.device
    ) -> BlockIds:
        """`ValueError` for out-of-range or repeated ids."""
        values = tuple(int(b) for b in block_ids)
        if len(set(values)) != len(values):
            raise ValueError("block ids must not repeat")
        bad = [b for b in values if not 0 <= b < num_cache_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} out of range for a cache of {num_cache_blocks}")
        return cls(values, device)

    @property
    def tensor(self) -> torch.Tensor:
        """The ids as int64 ``[num_blocks]`` on the device, uploaded on first use on the
        calling thread's current stream: a channel end's own (`CopyStream`). Uploaded on the
        engine's stream, the copy would wait for every step the engine had queued there."""
        if self._tensor is None:
            self._tensor = torch.tensor(self.values, dtype=torch.int64, device=self.device)
        return self._tensor


def runs(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first id, length) of each run of consecutive ascending ids."""
    found: list[tuple[int, int, int]] = []
    for position, block_id in enumerate(values):
        if found and found[-1][1] + found[-1][2] == block_id:
            found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
        else:
            found.append((position, block_id, 1))
    return found


def gather_chunk(
    planes: torch.Tensor, block_ids: BlockIds, chunk: Chunk, out: torch.Tensor
) -> None:
    """Copy the chunk's blocks out of the cache's moved heads (`planes`, a `heads_view`) into
    `out` (a `chunk_view`).

    One `index_select` when the moved heads are the whole cache (contiguous) or on GPU. On CPU
    a head slice is copied one run of consecutive ids at a time: `index_select`'s CPU kernel
    copies a strided source ~5x slower than `copy_` does (bench/kv_transfer_tp.py)."""
    source = planes[chunk.plane_start : chunk.plane_stop]
    if planes.device.type == "cpu" and not planes.is_contiguous():
        for position, first, length in runs(block_ids.values[chunk.block_start : chunk.block_stop]):
            out[:, position : position + length].copy_(source[:, first : first + length])
        return
    ids = block_ids.tensor[chunk.block_start : chunk.block_stop]
    torch.index_select(source, 1, ids, out=out)


def scatter_chunk(
    planes: torch.Tensor, block_ids: BlockIds, chunk: Chunk, src: torch.Tensor
) -> None:
    """Copy `src` (a `chunk_view`) into the chunk's blocks of the cache's moved heads
    (`planes`, a `heads_view`).

    On CPU one strided copy per run of consecutive ids: ~2x faster than `index_copy_`, whose
    CPU kernel does not copy whole rows. On GPU one `index_copy_` kernel."""
    target = planes[chunk.plane_start : chunk.plane_stop]
    if src.device != planes.device:
        src = src.to(planes.device)
    if planes.device.type != "cpu":
        target.index_copy_(1, block_ids.tensor[chunk.block_start : chunk.block_stop], src)
        return
    for position, first, length in runs(block_ids.values[chunk.block_start : chunk.block_stop]):
        target[:, first : first + length].copy_(src[:, position : position + length])
