"""A serving process freezes its start-up heap: what is alive then is skipped by later
collections, what is made after is collected as before."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from engine.startup_heap import freeze_startup_heap


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # (the rest of the suite runs in this process)


def test_objects_alive_at_start_up_are_frozen_and_later_garbage_is_collected(
    unfrozen_after: None,
) -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    kept = [Node() for _ in range(1000)]
    freeze_startup_heap()
    assert gc.get_freeze_count() >= len(kept)
    tracked_before = len(gc.get_objects())
    garbage = [Node() for _ in range(1000)]
    del garbage
    assert gc.collect() >= 1000  # the cycles made after the freeze are collected
    assert len(gc.get_objects()) <= tracked_before + 10  # the frozen ones are not walked
