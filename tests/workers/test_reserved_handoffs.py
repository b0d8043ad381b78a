"""A decode worker's record of which hand-off holds each reservation: a cancel that overtakes
its reserve refuses it, and a reservation whose transfer never began expires."""

from __future__ import annotations

import time

import pytest

from decode_worker.reserved_handoffs import ReservedHandoffs


def test_a_cancel_that_comes_first_refuses_its_reserve_once() -> None:
    handoffs = ReservedHandoffs(ttl_s=60.0)
    handoffs.cancel_early("h1")
    assert handoffs.refuses("h1")
    assert not handoffs.refuses("h1")  # forgotten: ids are never reused
    assert not handoffs.refuses("h2")


def test_a_reservation_is_held_by_its_hand_off_only() -> None:
    handoffs = ReservedHandoffs(ttl_s=60.0)
    handoffs.hold("r", "h1")
    assert handoffs.holds("r", "h1") and not handoffs.holds("r", "h0")
    handoffs.hold("r", "h2")  # a later hand-off of the same request
    assert not handoffs.holds("r", "h1")
    handoffs.release("r")
    assert not handoffs.holds("r", "h2")


def test_reservations_expire_after_their_ttl_and_are_remembered_once() -> None:
    handoffs = ReservedHandoffs(ttl_s=0.05)
    handoffs.hold("old", "h1")
    time.sleep(0.1)
    handoffs.hold("new", "h2")
    assert handoffs.expire() == ["old"]
    assert handoffs.holds("new", "h2")
    assert handoffs.take_expired("old") and not handoffs.take_expired("old")
    assert not handoffs.take_expired("new")


def test_a_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        ReservedHandoffs(ttl_s=0.0)
