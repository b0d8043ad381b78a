"""The decode worker's memory of aborts that came before their requests."""

from __future__ import annotations

import pytest

from decode_worker.early_aborts import EarlyAborts


def test_an_early_abort_is_taken_once() -> None:
    aborts = EarlyAborts()
    aborts.add("a")
    assert not aborts.take("b")
    assert aborts.take("a")
    assert not aborts.take("a")
    assert len(aborts) == 0


def test_the_oldest_aborts_are_forgotten_beyond_the_capacity() -> None:
    aborts = EarlyAborts(capacity=3)
    for request_id in "abcd":
        aborts.add(request_id)
    aborts.add("b")  # aborted again: now the newest
    aborts.add("e")
    assert len(aborts) == 3
    assert [aborts.take(r) for r in "abcde"] == [False, True, False, True, True]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EarlyAborts(capacity=0)
