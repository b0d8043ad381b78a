"""A worker's channel table: only channels neither in use nor pinned close over the cap, least
recently used first; a request's pin passes to its receive."""

from __future__ import annotations

from kv_transfer import KVChannel
from kv_transfer.channel_table import ChannelTable


class _Channel:
    """Stands in for a KVChannel: the table only holds channels and hands them back."""


def _channel() -> KVChannel:
    return _Channel()  # type: ignore[return-value]


def test_idle_channels_close_over_the_cap_least_recently_used_first() -> None:
    table = ChannelTable(max_channels=2)
    a, b, c = _channel(), _channel(), _channel()
    assert table.add("a", a) == []
    assert table.add("b", b) == []
    assert table.take("r", "a") is a  # "a" is now the more recently used
    table.release("a")
    assert table.add("c", c) == [b]
    assert "a" in table and "c" in table and "b" not in table


def test_a_pinned_channel_stays_open_until_its_receive_ends() -> None:
    table = ChannelTable(max_channels=1)
    a, b = _channel(), _channel()
    table.add("a", a)
    assert table.pin("r", "a")
    assert not table.pin("s", "gone")  # not open: nothing to pin
    assert table.add("b", b) == []  # "a" is pinned: over the cap for now
    assert table.take("r", "a") is a  # the pin passes to the receive
    assert table.num_pins == 0
    assert table.add("c", _channel()) == [b]  # "a" is receiving
    assert table.release("a") == [a]  # idle now, and over the cap: closed at once
    assert "c" in table and "a" not in table


def test_a_cancelled_reservation_unpins_its_channel() -> None:
    table = ChannelTable(max_channels=1)
    a = _channel()
    table.add("a", a)
    table.pin("r", "a")
    assert table.add("b", _channel()) == []  # "a" is pinned
    assert table.unpin("r") == [a]  # idle now, and over the cap


def test_a_receive_on_another_channel_ends_the_pin_it_had() -> None:
    table = ChannelTable(max_channels=1)
    a, b = _channel(), _channel()
    table.add("a", a)
    table.pin("r", "a")
    table.add("b", b)  # "a" stays: pinned
    assert table.take("r", "b") is b  # the receive came on "b": the pin of "a" ends
    assert table.num_pins == 0
    assert table.release("b") == [a]  # both idle: the least recently used goes


def test_a_channel_marked_in_use_as_it_opens_stays_until_released() -> None:
    """The prefill side's way: ``add(..., in_use=True)``, then ``use`` for later transfers."""
    table = ChannelTable(max_channels=1)
    a, b = _channel(), _channel()
    table.add("d0", a, in_use=True)
    assert table.add("d1", b, in_use=True) == []  # "d0" is sending
    assert table.release("d0") == [a]
    assert not table.use("d0", a)  # closed over the cap: a new one must open
    assert table.use("d1", b)
    assert table.release("d1") == [] and table.release("d1") == []  # both its transfers end
    assert len(table) == 1
