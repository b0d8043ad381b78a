"""KV cache layout: the shape facts both ends of a channel must agree on.

Lifecycle: built from a worker's cache tensor (`KVCacheLayout.from_cache`) → sent as JSON in
the channel handshake → `check_compatible` on both sides before the first transfer →
`check_cache` on every transfer (the tensor handed in still matches).

The cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`. For
moving blocks it is viewed as planes: `[num_layers * 2, num_blocks, plane_numel]`, where a
plane is one layer's K (or V) of one block, contiguous in memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.errors import LayoutMismatchError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Everything about a KV cache that must match across a channel (not the block count)."""

    dtype: str  # element type: "float32" | "bfloat16" | "float16"
    block_size: int  # tokens per block
    num_layers: int  # decoder layers
    num_kv_heads: int  # KV heads held by this worker
    head_dim: int  # elements per head

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {list(DTYPES)}")
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{field.name} must be a positive int, got {value!r}")

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor) -> KVCacheLayout:
        """The layout of a cache tensor `[num_layers, 2, num_blocks, block_size, heads, dim]`."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "KV cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim],"
                f" got shape {tuple(kv_cache.shape)}"
            )
        names = {dtype: name for name, dtype in DTYPES.items()}
        if kv_cache.dtype not in names:
            raise ValueError(f"unsupported KV dtype {kv_cache.dtype}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(names[kv_cache.dtype], block_size, num_layers, num_kv_heads, head_dim)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """The shape of a cache of ``num_blocks`` in this layout (what from_cache reads)."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_planes(self) -> int:
        """K and V of every layer: the first dimension of the planes view."""
        return self.num_layers * 2

    @property
    def plane_numel(self) -> int:
        """Elements of one layer's K (or V) in one block."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def plane_nbytes(self) -> int:
        return self.plane_numel * self.torch_dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V: what one block costs to move."""
        return self.num_planes * self.plane_nbytes

    def first_difference(self, other: KVCacheLayout) -> tuple[str, Any, Any] | None:
        """(field name, this value, other value) of the first field that differs, or None."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return field.name, mine, theirs
        return None

    def check_compatible(self, peer: KVCacheLayout) -> None:
        """Raise `LayoutMismatchError` naming the first field where `peer` differs."""
        difference = self.first_difference(peer)
        if difference is not None:
            name, mine, theirs = difference
            raise LayoutMismatchError(
                f"KV layout mismatch on {name}: this side has {mine}, the peer has {theirs}"
            )

    def check_cache(self, kv_cache: torch.Tensor, device: torch.device) -> int:
        """Check a cache tensor against this layout and the channel's device; return its blocks."""
        if not kv_cache.is_contiguous():
            raise ValueError("KV cache must be contiguous")
        if kv_cache.device != device:
            raise ValueError(f"KV cache is on {kv_cache.device}, the channel on {device}")
        difference = self.first_difference(KVCacheLayout.from_cache(kv_cache))
        if difference is not None:
            name, mine, theirs = difference
            raise ValueError(f"KV cache has {name}={theirs}, the channel's layout has {mine}")
        return int(kv_cache.shape[2])

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object) -> KVCacheLayout:
        """Parse the peer's layout; raise `ValueError` on anything but exactly our fields."""
        names = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise ValueError(f"malformed KV layout from the peer: {data!r}")
        return cls(**data)
