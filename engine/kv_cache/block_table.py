"""A sequence's block table: the physical block of each of its logical blocks.

A list, as the block manager reads and writes it, that keeps a numpy copy of itself up to date
as it changes: a step's block tables are then copied into the runner's arrays a row per
sequence, instead of converting every sequence's Python list, element by element, every step
(docs/benchmarks.md, "Block tables kept as arrays"). Only ``append`` and assignment to one
index change it; every other list mutator raises, so the
copy cannot fall behind.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

_MIN_CAPACITY = 16


class BlockTable(list[int]):
    __slots__ = ("_array",)

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        super().__init__(block_ids)
        self._array = np.zeros(max(_MIN_CAPACITY, 2 * len(self)), dtype=np.int64)
        self._array[: len(self)] = self

    def __reduce__(self) -> tuple[type[BlockTable], tuple[list[int]]]:
        """Pickled and copied as its list: rebuilt by ``__init__`` (list's own way would
        ``extend`` an empty one)."""
        return BlockTable, (list(self),)

    @property
    def array(self) -> np.ndarray:
        """[len(self)] int64: the block ids, as an array (a view: read it, don't keep it)."""
        return self._array[: len(self)]

    def append(self, block_id: int) -> None:
        num_blocks = len(self)
        if num_blocks == len(self._array):
            self._array = np.concatenate([self._array, np.zeros_like(self._array)])
        self._array[num_blocks] = block_id
        super().append(block_id)

    def __setitem__(self, index: Any, block_id: Any) -> None:
        if isinstance(index, slice):
            raise TypeError(f"a block table is assigned one index at a time, not {index!r}")
        super().__setitem__(index, block_id)  # (rejects an index out of range)
        self._array[operator.index(index) % len(self)] = block_id


def _refused(name: str) -> Any:
    def refuse(self: BlockTable, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"BlockTable.{name}: a block table changes only by append and by assigning one "
            "index (its numpy copy follows those two)"
        )

    return refuse


for _mutator in (
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "__delitem__",
    "__iadd__",
    "__imul__",
):
    setattr(BlockTable, _mutator, _refused(_mutator))
