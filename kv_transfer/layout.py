"""KV cache layout: the shape facts both ends of a channel must agree on, and the heads it moves.

Lifecycle: built from a worker's cache tensor (`KVCacheLayout.from_cache`, with the model's KV
heads the cache holds when the worker is one rank of a tensor-parallel group) → `moving(heads)`
when the channel moves only some of them → sent as JSON in the channel handshake →
`check_compatible` on both sides before the first transfer → `check_cache` on every transfer
(the tensor handed in still matches).

The cache is one tensor `[num_layers, kv_planes, num_blocks, block_size, num_kv_heads,
head_dim]`, a layer's planes being its K and V (2) or its latent entries (1: multi-head latent
attention). For moving blocks it is viewed as planes: `[num_layers * kv_planes, num_blocks,
plane_numel]`, where a plane is one layer's K (or V, or latent) of one block, contiguous in
memory. A channel moves a range of
consecutive KV heads (every head of the cache unless told otherwise): the wire carries
`[planes, blocks, block_size, num_moved_heads, head_dim]`. Both ends must agree on the dtype,
block size, layer count, planes per layer, head size, the model's ids of the moved heads and
its KV cache groups, and for a quantized cache (float8 e4m3 or int8 elements) on the scales of
the moved heads; the heads each end holds and its block count are its own. Where a model's
sliding and full layers keep block tables of their own (KV cache groups), `num_layers` counts a
block's layer slots (the largest group's layers) and `cache_groups` says which layer is in
which slot of which group's blocks; the channel moves blocks alike whatever group they hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kv_transfer.errors import LayoutMismatchError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # a quantized cache's elements (with its scales)
    "int8": torch.int8,
}
_QUANTIZED_DTYPES = ("float8_e4m3fn", "int8")
# a quantized cache's scales: per model layer, a scale per plane for each of the model's KV heads:
# the K then the V scale (kv_planes 2), or a latent cache's one scale (kv_planes 1, one head)
# (engine/kv_cache/kv_quantization.py's KVCacheScales.per_layer)
KVScales = tuple[tuple[tuple[float, ...], ...], ...]
_SHAPE_FIELDS = ("dtype", "block_size", "num_layers", "kv_planes", "num_kv_heads", "head_dim")
_POSITIVE_FIELDS = _SHAPE_FIELDS[1:]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Everything about a KV cache that must match across a channel (not the block count), and
    which of its heads the channel moves."""

    dtype: str  # element type: "float32" | "bfloat16" | "float16"
    block_size: int  # tokens per block
    num_layers: int  # decoder layers
    num_kv_heads: int  # KV heads this cache holds (a tensor-parallel rank's share)
    head_dim: int  # elements per head
    kv_planes: int = 2  # per layer: K and V (2), or a latent (1)
    first_kv_head: int = 0  # the model's id of the cache's first KV head
    moved_kv_heads: range | None = None  # the model's KV heads the channel moves, consecutive
    # and among the cache's own; None: every head the cache holds
    # the model's KV cache groups where it has several (engine/kv_cache/cache_groups.py: which
    # layers hold which slot of a block, and each group's window); None: one group, layer i in
    # slot i
    cache_groups: str | None = None
    # a quantized cache's scales (KVScales: every KV head of the model); None for a float cache
    kv_scales: KVScales | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {list(DTYPES)}")
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.kv_planes not in (1, 2):
            raise ValueError(f"kv_planes must be 1 or 2, got {self.kv_planes!r}")
        if type(self.first_kv_head) is not int or self.first_kv_head < 0:
            raise ValueError(f"first_kv_head must be an int >= 0, got {self.first_kv_head!r}")
        if self.cache_groups is not None and not isinstance(self.cache_groups, str):
            raise ValueError(f"cache_groups must be a string or None, got {self.cache_groups!r}")
        if (self.kv_scales is None) != (self.dtype not in _QUANTIZED_DTYPES):
            raise ValueError(
                f"kv_scales must be given exactly for a quantized cache, got "
                f"{'none' if self.kv_scales is None else 'scales'} for dtype {self.dtype}"
            )
        if self.kv_scales is not None and any(
            len(planes) != self.kv_planes for planes in self.kv_scales
        ):
            raise ValueError(
                f"kv_scales must have {self.kv_planes} plane(s) per layer, as the cache has"
            )
        moved = self.moved_kv_heads
        if moved is None:
            return
        if not isinstance(moved, range) or moved.step != 1 or len(moved) == 0:
            raise ValueError(f"moved_kv_heads must be a non-empty range of step 1, got {moved!r}")
        if moved.start < self.kv_heads.start or moved.stop > self.kv_heads.stop:
            raise ValueError(
                f"moved_kv_heads {describe_heads(moved)} must lie within the KV heads this "
                f"cache holds, {describe_heads(self.kv_heads)}"
            )

    @classmethod
    def from_cache(
        cls,
        kv_cache: torch.Tensor,
        kv_heads: range | None = None,
        cache_groups: str | None = None,
        kv_scales: KVScales | None = None,
    ) -> KVCacheLayout:
        """The layout of a cache tensor `[num_layers, kv_planes, num_blocks, block_size, heads,
        dim]`. ``kv_heads``: the model's KV heads it holds (a rank's ``shard.kv_heads``;
        default: the cache's heads are the model's first ones); ``cache_groups`` and
        ``kv_scales``: as the fields."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] not in (1, 2):
            raise ValueError(
                "KV cache must be [num_layers, kv_planes (2, or 1 for a latent cache), "
                f"num_blocks, block_size, num_kv_heads, head_dim], got shape "
                f"{tuple(kv_cache.shape)}"
            )
        names = {dtype: name for name, dtype in DTYPES.items()}
        if kv_cache.dtype not in names:
            raise ValueError(f"unsupported KV dtype {kv_cache.dtype}")
        num_layers, kv_planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        layout = cls(
            names[kv_cache.dtype],
            block_size,
            num_layers,
            num_kv_heads,
            head_dim,
            kv_planes,
            cache_groups=cache_groups,
            kv_scales=kv_scales,
        )
        return layout if kv_heads is None else layout.holding(kv_heads)

    def holding(self, kv_heads: range) -> KVCacheLayout:
        """This layout for a cache that holds the model's ``kv_heads`` (every one moved)."""
        if kv_heads.step != 1 or len(kv_heads) != self.num_kv_heads:
            raise ValueError(
                f"kv_heads {kv_heads} must be {self.num_kv_heads} consecutive heads "
                f"(num_kv_heads {self.num_kv_heads})"
            )
        return dataclasses.replace(self, first_kv_head=kv_heads.start, moved_kv_heads=None)

    def moving(self, heads: range) -> KVCacheLayout:
        """This layout for a channel that moves only the model's KV ``heads`` of the cache."""
        return dataclasses.replace(self, moved_kv_heads=heads)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """The shape of a cache of ``num_blocks`` in this layout (what from_cache reads)."""
        return (
            self.num_layers,
            self.kv_planes,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this cache holds."""
        return range(self.first_kv_head, self.first_kv_head + self.num_kv_heads)

    @property
    def moved_heads(self) -> range:
        """The model's KV heads the channel moves."""
        return self.kv_heads if self.moved_kv_heads is None else self.moved_kv_heads

    @property
    def moved_first(self) -> int:
        """Where the first moved head sits among the cache's own heads."""
        return self.moved_heads.start - self.first_kv_head

    @property
    def num_moved_heads(self) -> int:
        return len(self.moved_heads)

    @property
    def moves_whole_cache(self) -> bool:
        return self.moved_heads == self.kv_heads

    @property
    def num_planes(self) -> int:
        """K and V (or the latent) of every layer: the first dimension of the planes view."""
        return self.num_layers * self.kv_planes

    @property
    def plane_numel(self) -> int:
        """Elements of one layer's K (or V, or latent) in one block of the cache."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def plane_nbytes(self) -> int:
        return self.plane_numel * self.torch_dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of the cache across all layers and planes."""
        return self.num_planes * self.plane_nbytes

    @property
    def moved_plane_numel(self) -> int:
        """Elements of the moved heads of one plane: what one plane puts on the wire."""
        return self.block_size * self.num_moved_heads * self.head_dim

    @property
    def moved_plane_nbytes(self) -> int:
        return self.moved_plane_numel * self.torch_dtype.itemsize

    @property
    def moved_block_nbytes(self) -> int:
        """Bytes of the moved heads of one block, all layers and planes: what a block costs."""
        return self.num_planes * self.moved_plane_nbytes

    def mismatch(
        self, peer: KVCacheLayout, role: Literal["sender", "receiver"] | None = None
    ) -> str | None:
        """Why ``peer`` cannot be this channel's other end, naming the first field that
        differs, or None. ``role``: this side's, for how the moved heads are worded."""
        for name in _SHAPE_FIELDS:
            if name == "num_kv_heads":
                heads = self._heads_mismatch(peer, role)
                if heads is not None:
                    return heads
                continue
            mine, theirs = getattr(self, name), getattr(peer, name)
            if mine != theirs:
                return f"KV layout mismatch on {name}: this side has {mine}, the peer has {theirs}"
        if self.cache_groups != peer.cache_groups:
            return (
                f"KV layout mismatch on cache_groups: this side has {self.cache_groups}, the "
                f"peer has {peer.cache_groups}"
            )
        return self._scales_mismatch(peer)

    def _scales_mismatch(self, peer: KVCacheLayout) -> str | None:
        """A quantized cache's blocks read the same at both ends only with the same scales
        for the heads they move: the first layer, plane and head whose scale differs."""
        mine, theirs = self.kv_scales, peer.kv_scales
        if mine is None or theirs is None:
            return None  # both float: the dtypes matched
        if len(mine) != len(theirs):
            return (
                f"KV layout mismatch on kv_scales: this side has scales for {len(mine)} "
                f"layers, the peer for {len(theirs)}"
            )
        names = ("K", "V") if self.kv_planes == 2 else ("latent",)
        for layer, (my_planes, their_planes) in enumerate(zip(mine, theirs)):
            for plane, name in enumerate(names):
                for head in self.moved_heads:
                    a, b = _scale_of(my_planes[plane], head), _scale_of(their_planes[plane], head)
                    if a != b:
                        return (
                            f"KV layout mismatch on kv_scales: layer {layer} {name} head {head} "
                            f"has scale {a} on this side, {b} on the peer"
                        )
        return None

    def _heads_mismatch(
        self, peer: KVCacheLayout, role: Literal["sender", "receiver"] | None
    ) -> str | None:
        """Both ends must move the same heads of the model. Two ends that each move their
        whole cache hold different numbers of heads when the counts differ: named as such."""
        if self.moved_heads == peer.moved_heads:
            return None
        whole = self.moved_kv_heads is None and peer.moved_kv_heads is None
        if whole and self.num_kv_heads != peer.num_kv_heads:
            return (
                f"KV layout mismatch on num_kv_heads: this side has {self.num_kv_heads}, "
                f"the peer has {peer.num_kv_heads}"
            )
        mine, theirs = {"sender": ("moves", "expects"), "receiver": ("expects", "moves")}.get(
            role or "", ("moves", "moves")
        )
        return (
            f"KV layout mismatch on kv_heads: this side {mine} heads "
            f"{describe_heads(self.moved_heads)}, the peer {theirs} "
            f"{describe_heads(peer.moved_heads)}"
        )

    def check_compatible(
        self, peer: KVCacheLayout, role: Literal["sender", "receiver"] | None = None
    ) -> None:
        """Raise `LayoutMismatchError` naming the first field where `peer` differs."""
        reason = self.mismatch(peer, role)
        if reason is not None:
            raise LayoutMismatchError(reason)

    def check_cache(self, kv_cache: torch.Tensor, device: torch.device) -> int:
        """Check a cache tensor against this layout and the channel's device; return its blocks."""
        if not kv_cache.is_contiguous():
            raise ValueError("KV cache must be contiguous")
        if kv_cache.device != device:
            raise ValueError(f"KV cache is on {kv_cache.device}, the channel on {device}")
        # a quantized cache is checked with this layout's scales: the tensor cannot tell them
        found = KVCacheLayout.from_cache(
            kv_cache, kv_scales=self.kv_scales if kv_cache.element_size() == 1 else None
        )
        for name in _SHAPE_FIELDS:
            mine, theirs = getattr(self, name), getattr(found, name)
            if mine != theirs:
                raise ValueError(f"KV cache has {name}={theirs}, the channel's layout has {mine}")
        return int(kv_cache.shape[2])

    def to_json(self) -> dict[str, Any]:
        moved = self.moved_kv_heads
        return {
            **{name: getattr(self, name) for name in _SHAPE_FIELDS},
            "first_kv_head": self.first_kv_head,
            "moved_kv_heads": None if moved is None else [moved.start, moved.stop],
            "cache_groups": self.cache_groups,
            "kv_scales": None
            if self.kv_scales is None
            else [[list(plane) for plane in planes] for planes in self.kv_scales],
        }

    @classmethod
    def from_json(cls, data: object) -> KVCacheLayout:
        """Parse the peer's layout; raise `ValueError` on anything but exactly our fields."""
        names = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise ValueError(f"malformed KV layout from the peer: {data!r}")
        moved = data["moved_kv_heads"]
        if moved is not None:
            if not (
                isinstance(moved, list) and len(moved) == 2 and all(type(v) is int for v in moved)
            ):
                raise ValueError(f"malformed moved_kv_heads from the peer: {moved!r}")
            moved = range(moved[0], moved[1])
        return cls(**{**data, "moved_kv_heads": moved, "kv_scales": _scales_from_json(data)})


def _scale_of(plane: tuple[float, ...], head: int) -> float | None:
    return plane[head] if 0 <= head < len(plane) else None


def _scales_from_json(data: dict[str, Any]) -> KVScales | None:
    """The peer's ``kv_scales`` as tuples; ``ValueError`` unless [layer][plane][head] numbers,
    the planes K and V, or a latent cache's one."""
    raw = data["kv_scales"]
    if raw is None:
        return None
    malformed = ValueError(f"malformed kv_scales from the peer: {raw!r}")
    if not isinstance(raw, list):
        raise malformed
    layers = []
    for planes in raw:
        if not (isinstance(planes, list) and len(planes) in (1, 2)):
            raise malformed
        scales = []
        for plane in planes:
            if not isinstance(plane, list) or not all(
                type(scale) in (int, float) for scale in plane
            ):
                raise malformed
            scales.append(tuple(float(scale) for scale in plane))
        layers.append(tuple(scales))
    return tuple(layers)


def describe_heads(heads: range) -> str:
    """``"2-3"`` for heads 2 and 3; ``"2"`` for head 2 alone."""
    if len(heads) == 1:
        return str(heads.start)
    return f"{heads.start}-{heads.stop - 1}"
