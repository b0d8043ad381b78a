"""A value an attention backend builds once per step and reuses in the step's other layers.

Every layer of a step in one KV cache group gets the same ``AttentionMetadata`` object, so its
identity names the step and the group: a new object means a new step (or a group not seen in
this one), and the value is built again. A value is kept per group of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from engine.attention.metadata import AttentionMetadata

T = TypeVar("T")


_MAX_GROUPS_KEPT = 8  # a model of more cache groups builds some values again in a step


class PerStep(Generic[T]):
    def __init__(self) -> None:
        self._built: list[tuple[AttentionMetadata, T]] = []  # newest last

    def get(self, metadata: AttentionMetadata, build: Callable[[], T]) -> T:
        """The value built for ``metadata``'s step, building it on the step's first call."""
        for seen, value in self._built:
            if seen is metadata:
                return value
        value = build()
        self._built = [*self._built[-(_MAX_GROUPS_KEPT - 1) :], (metadata, value)]
        return value
