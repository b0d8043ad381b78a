"""A value an attention backend builds once per step and reuses in the step's other layers.

Every layer of a step gets the same ``AttentionMetadata`` object, so its identity names the
step: a new object means a new step, and the value is built again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from engine.attention.metadata import AttentionMetadata

T = TypeVar("T")


class PerStep(Generic[T]):
    def __init__(self) -> None:
        self._step: tuple[AttentionMetadata, T] | None = None

    def get(self, metadata: AttentionMetadata, build: Callable[[], T]) -> T:
        """The value built for ``metadata``'s step, building it on the step's first call."""
        if self._step is None or self._step[0] is not metadata:
            self._step = (metadata, build())
        return self._step[1]
