"""Which layers share a block table: the model's KV cache groups.

Layers that attend alike (every one sees the whole context, or every one the same sliding
window) keep their KV in blocks of one table per sequence: a group. A model whose layers all
attend alike has one group of all its layers. A model that mixes sliding and full layers
(Gemma 2/3, gpt-oss, Qwen2 with ``max_window_layers``) has groups of each kind, so a sliding
group's table can give back the blocks before its window while a full group keeps them all.

Every group has the same number of layers (``num_slots``; a group short of it leaves slots
unused), so the cache is one tensor ``[num_slots, kv_planes, num_blocks, ...]``, one pool of
blocks serves every group, and a block of any group is the same bytes to allocate and to move:
a layer reads slot ``place(layer).slot`` of the blocks in its group's table. As in vLLM's
hybrid KV cache manager, the kinds are split into groups of the smallest kind's size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheGroup:
    window: int | None  # positions a token of these layers sees, itself included; None: all
    layers: tuple[int, ...]  # the model's layer ids; layers[i] holds cache slot i


@dataclass(frozen=True, slots=True)
class LayerPlace:
    group: int  # the layer's cache group: which of a sequence's block tables it reads
    slot: int  # its slot in the cache tensor's first dimension
    layer: int  # the model's id of the layer


@dataclass(frozen=True, slots=True)
class CacheGroups:
    groups: tuple[CacheGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups or any(not group.layers for group in self.groups):
            raise ValueError(f"cache groups must be non-empty, got {self.groups}")

    @classmethod
    def single(cls, num_layers: int) -> CacheGroups:
        """One group of every layer, seeing the whole context: layer i in slot i."""
        return cls((CacheGroup(None, tuple(range(num_layers))),))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Layers a block holds: the largest group's."""
        return max(len(group.layers) for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def mean_positions_read(self, num_positions: int) -> float:
        """The KV positions a token reads over ``num_positions`` positions (itself included),
        averaged over the layers: each sliding layer's window at most (``pdserve plan``'s
        roofline)."""
        return self.mean_pairs(num_positions - 1, 1)  # the one token's pairs

    def mean_pairs(self, start: int, count: int) -> float:
        """The (query, key) pairs of ``count`` tokens after ``start`` positions, each attending
        to the positions up to its own (a sliding layer's window at most), averaged over the
        layers."""
        pairs = sum(len(group.layers) * _pairs(start, count, group.window) for group in self.groups)
        return pairs / sum(len(group.layers) for group in self.groups)

    def place(self, layer: int) -> LayerPlace:
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return LayerPlace(index, group.layers.index(layer), layer)
        raise KeyError(f"layer {layer} is in no cache group")

    @property
    def handshake_name(self) -> str | None:
        """How a KV layout handshake names these groups (kv_transfer/layout.py's
        ``cache_groups``): ``describe()`` where there are several, None for one."""
        return self.describe() if self.num_groups > 1 else None

    def describe(self) -> str:
        """E.g. ``full:0,2|window 24:1,3``, as a layout handshake names it."""
        return "|".join(
            f"{'full' if g.window is None else f'window {g.window}'}:"
            + ",".join(map(str, g.layers))
            for g in self.groups
        )


def _pairs(start: int, count: int, window: int | None) -> int:
    """Sum over the positions p = start + 1 .. start + count of min(p, window)."""
    first, last = start + 1, start + count
    if window is None or last <= window:
        return count * start + count * (count + 1) // 2
    if first >= window:
        return count * window
    return (first + window) * (window - first + 1) // 2 + (last - window) * window


def cache_groups_for(
    num_layers: int, sliding_window: int | None, sliding_layers: tuple[int, ...]
) -> CacheGroups:
    """The groups of a model whose ``sliding_layers`` see ``sliding_window`` positions and whose
    other layers see the whole context."""
    sliding = [layer for layer in range(num_layers) if layer in sliding_layers]
    full = [layer for layer in range(num_layers) if layer not in sliding_layers]
    if sliding_window is None or not sliding:
        return CacheGroups.single(num_layers)
    if not full:
        return CacheGroups((CacheGroup(sliding_window, tuple(sliding)),))
    size = min(len(sliding), len(full))
    groups = [
        CacheGroup(window, tuple(layers[start : start + size]))
        for window, layers in ((None, full), (sliding_window, sliding))
        for start in range(0, len(layers), size)
    ]
    return CacheGroups(tuple(groups))
