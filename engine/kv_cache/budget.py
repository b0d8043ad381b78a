"""How many KV blocks a worker gets: from an explicit count, a byte budget, or free memory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the router builds KVBudget on a CPU head node
    import torch

# A CPU worker's default KV cache: a quarter of available host memory, at most 4 GiB (as vLLM's
# CPU backend), unless PDSERVE_CPU_KV_CACHE_BYTES says otherwise.
_CPU_DEFAULT_FRACTION = 0.25
_CPU_DEFAULT_MAX_BYTES = 4 << 30
CPU_KV_CACHE_BYTES_ENV = "PDSERVE_CPU_KV_CACHE_BYTES"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The cache tensor: ``[num_layers, kv_planes, num_blocks, block_size, num_kv_heads,
    head_dim]``, where a layer's planes are K and V (2) or a latent (1: ModelConfig.kv_planes).
    With several KV cache groups (engine/kv_cache/cache_groups.py) ``num_layers`` is the slots
    a block holds (the largest group's layers), and each group's blocks come from the one pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_planes: int = 2
    num_cache_groups: int = 1  # block tables per sequence

    @property
    def bytes_per_block(self) -> int:
        import torch

        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_plane = self.block_size * self.num_kv_heads * self.head_dim * element_size
        return self.num_layers * self.kv_planes * per_plane

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (
            self.num_layers,
            self.kv_planes,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )


@dataclass(frozen=True, slots=True)
class KVBudget:
    num_blocks: int | None = None  # exact block count; wins over everything else
    memory_bytes: int | None = None  # bytes for the cache tensor
    memory_fraction: float = 0.9  # CUDA: fraction of the GPU's memory this worker may use in all

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.memory_bytes}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.memory_fraction}"
            )


def available_host_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def _cpu_default_bytes() -> int:
    configured = os.environ.get(CPU_KV_CACHE_BYTES_ENV)
    if configured:
        try:
            return int(configured)
        except ValueError:
            raise ValueError(f"{CPU_KV_CACHE_BYTES_ENV} must be an integer byte count") from None
    return min(int(available_host_bytes() * _CPU_DEFAULT_FRACTION), _CPU_DEFAULT_MAX_BYTES)


def gpu_kv_bytes(
    total: int, free: int, own: int, memory_fraction: float, peak_activation_bytes: int
) -> int:
    """This worker's KV bytes on a GPU: its share of the GPU (``memory_fraction`` of ``total``)
    less what it holds already (``own``: weights and buffers) and its peak activations, and
    never more than is free now (other processes, a worker sharing the GPU included).

    Counting only this worker's own memory against its share is what lets a prefill and a
    decode worker share one GPU: the second to start is not charged for the first one's cache.
    """
    return min(int(total * memory_fraction) - own, free) - peak_activation_bytes


def num_host_kv_slots(kv_offload_gb: float, layout: KVLayout) -> int:
    """Blocks of ``layout`` (this rank's: every layer slot and plane, at its storage dtype) that
    ``kv_offload_gb`` GiB of host memory hold; raises ValueError naming it when none fits."""
    num_slots = int(kv_offload_gb * (1 << 30)) // layout.bytes_per_block
    if num_slots < 1:
        raise ValueError(
            f"kv_offload_gb ({kv_offload_gb}) holds no KV block: a block needs "
            f"{layout.bytes_per_block} bytes ({layout.bytes_per_block / (1 << 30):.3g} GiB)"
        )
    return num_slots


def num_kv_blocks(
    budget: KVBudget,
    layout: KVLayout,
    device: torch.device,
    peak_activation_bytes: int = 0,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks that fit the budget; called once at start-up after the weights are loaded.
    ``extra_bytes_per_block``: what each block costs besides ``layout``'s (a draft model's
    cache in the same blocks)."""
    if budget.num_blocks is not None:
        return budget.num_blocks
    if budget.memory_bytes is not None:
        memory = budget.memory_bytes
    elif device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        own = torch.cuda.memory_reserved(device)
        memory = gpu_kv_bytes(total, free, own, budget.memory_fraction, peak_activation_bytes)
    else:
        memory = _cpu_default_bytes() - peak_activation_bytes
    block_bytes = layout.bytes_per_block + extra_bytes_per_block
    num_blocks = memory // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache ({memory} bytes available, a block needs "
            f"{block_bytes}); lower the model size or raise the memory budget"
        )
    return int(num_blocks)
