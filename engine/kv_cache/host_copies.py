"""The bytes of the host-memory tier, and the copies between it and the device cache.

The host buffer holds a KV block per slot, ``[num_host_slots, num_slots, kv_planes, block_size,
num_kv_heads, head_dim]`` (``num_slots``: the cache's layer slots): block-major, so one slot's
block is one contiguous run of bytes and each copy to or from it is one DMA. It has the cache's
dtype (a quantized cache's 8-bit elements move as they are) and is page-locked, where it lies,
when the cache is on a GPU. engine/kv_cache/host_tier.py decides what moves; ``swap`` moves it,
swap-outs first.

On a GPU the copies run on a stream of their own: it first waits for everything queued on the
compute stream so far (a swap-out reads a block the steps before wrote, and a swap-in writes a
block they may still read), and the compute stream waits for it before anything launched after
``swap`` (the step's copy-on-write copies and forward read what the swap-ins wrote). The host
goes on meanwhile: nothing here waits for the device. Under async scheduling the step before is
launched, not finished, when the next one's swaps are queued; the waits above order them after
it on the device. On a CPU the copies are made at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch-free at import, as the rest of the package
    import torch

_BLOCKS_PER_BATCH = 32  # a GPU copy stages at most this many blocks on the device at once


def host_cache_like(kv_cache: torch.Tensor, num_host_slots: int) -> torch.Tensor:
    """A host buffer of ``num_host_slots`` blocks of ``kv_cache``'s layout and dtype, page-locked
    when the cache is on a GPU."""
    import torch

    num_slots, kv_planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    # [num_host_slots, num_slots, kv_planes, block_size, num_kv_heads, head_dim]
    shape = (num_host_slots, num_slots, kv_planes, block_size, num_kv_heads, head_dim)
    host = torch.empty(shape, dtype=kv_cache.dtype)
    if kv_cache.device.type == "cuda":
        _page_lock(host)
    return host


def _page_lock(host: torch.Tensor) -> None:
    """Page-lock ``host``'s memory where it lies (cudaHostRegister) until ``host`` is collected,
    as torch's checkpoint stager does. Not ``pin_memory=True``: torch's pinned allocator rounds
    each buffer up to a power of two bytes, so a 40 GiB tier would lock 64 GiB."""
    import torch

    cudart = torch.cuda.cudart()
    address, num_bytes = host.data_ptr(), host.numel() * host.element_size()
    error = int(cudart.cudaHostRegister(address, num_bytes, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(
            f"page-locking the host KV tier's {num_bytes} bytes failed (cudaError {error}); "
            "lower kv_offload_gb"
        )
    unlock = weakref.finalize(host, cudart.cudaHostUnregister, address)
    unlock.atexit = False  # not at exit: the CUDA context may be gone by then


class HostCopier:
    """Moves blocks between one rank's device cache and its host buffer; counts the bytes."""

    def __init__(self, kv_cache: torch.Tensor, host_cache: torch.Tensor) -> None:
        import torch

        if host_cache.shape[1:] != kv_cache.shape[:2] + kv_cache.shape[3:]:
            raise ValueError(
                f"host KV buffer {tuple(host_cache.shape)} does not hold blocks of the cache "
                f"{tuple(kv_cache.shape)}"
            )
        if host_cache.dtype != kv_cache.dtype:
            raise ValueError(f"host KV buffer is {host_cache.dtype}, the cache {kv_cache.dtype}")
        self._host_cache = host_cache  # held: its memory stays page-locked while it lives
        # both seen as bytes: a copy moves bits (no dtype's copy kernel needed, 8-bit ones too)
        self._device = kv_cache.view(torch.uint8)  # [num_slots, kv_planes, num_blocks, ...]
        self._host = host_cache.view(torch.uint8)  # [num_host_slots, num_slots, kv_planes, ...]
        self.block_bytes = host_cache[0].numel() * host_cache.element_size()
        self._stream: torch.cuda.Stream | None = None  # the copies' own stream on a GPU
        if kv_cache.device.type == "cuda":
            self._stream = torch.cuda.Stream(kv_cache.device)
        self.num_offloaded_bytes = 0  # device -> host
        self.num_loaded_bytes = 0  # host -> device

    @property
    def num_bytes_moved(self) -> tuple[int, int]:
        """(device -> host, host -> device) bytes so far."""
        return self.num_offloaded_bytes, self.num_loaded_bytes

    def swap(
        self, swap_outs: Sequence[tuple[int, int]], swap_ins: Sequence[tuple[int, int]]
    ) -> None:
        """Copy each (device block, host slot) of ``swap_outs`` to the host, then each (host
        slot, device block) of ``swap_ins`` to the device."""
        import torch

        if not swap_outs and not swap_ins:
            return
        if self._stream is None:
            self._swap_on_cpu(swap_outs, swap_ins)
        else:
            compute = torch.cuda.current_stream(self._device.device)
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                for start in range(0, len(swap_outs), _BLOCKS_PER_BATCH):
                    self._offload_on_gpu(swap_outs[start : start + _BLOCKS_PER_BATCH])
                for start in range(0, len(swap_ins), _BLOCKS_PER_BATCH):
                    self._load_on_gpu(swap_ins[start : start + _BLOCKS_PER_BATCH])
            compute.wait_stream(self._stream)
        self.num_offloaded_bytes += len(swap_outs) * self.block_bytes
        self.num_loaded_bytes += len(swap_ins) * self.block_bytes

    def _swap_on_cpu(
        self, swap_outs: Sequence[tuple[int, int]], swap_ins: Sequence[tuple[int, int]]
    ) -> None:
        if swap_outs:
            blocks, slots = _columns(swap_outs)
            self._host[slots] = self._device[:, :, blocks].movedim(2, 0)
        if swap_ins:
            slots, blocks = _columns(swap_ins)
            self._device[:, :, blocks] = self._host[slots].movedim(0, 2)

    def _offload_on_gpu(self, swap_outs: Sequence[tuple[int, int]]) -> None:
        """On the copy stream: gather the blocks into one contiguous tensor on the device, then
        one DMA per block into its page-locked slot."""
        from engine.host_to_device import to_device

        blocks = to_device(
            np.asarray([b for b, _ in swap_outs], np.int64), None, self._device.device
        )
        # [num_blocks, num_slots, kv_planes, block_size, num_kv_heads, head_dim * element bytes]
        staged = self._device.index_select(2, blocks).movedim(2, 0).contiguous()
        for index, (_, slot) in enumerate(swap_outs):
            self._host[slot].copy_(staged[index], non_blocking=True)

    def _load_on_gpu(self, swap_ins: Sequence[tuple[int, int]]) -> None:
        """On the copy stream: one DMA per page-locked slot into a contiguous tensor on the
        device, then a scatter into the blocks."""
        import torch

        from engine.host_to_device import to_device

        blocks = to_device(
            np.asarray([b for _, b in swap_ins], np.int64), None, self._device.device
        )
        staged = torch.empty(
            (len(swap_ins), *self._host.shape[1:]), dtype=torch.uint8, device=self._device.device
        )
        for index, (slot, _) in enumerate(swap_ins):
            staged[index].copy_(self._host[slot], non_blocking=True)
        self._device[:, :, blocks] = staged.movedim(0, 2)


def _columns(pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the second members of ``pairs`` as two int64 tensors on the CPU."""
    import torch

    array = torch.tensor(pairs, dtype=torch.int64)  # [len(pairs), 2]
    return array[:, 0], array[:, 1]
