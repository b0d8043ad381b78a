"""A decode worker's hand-off state machine, without a model: reserved -> pinned -> receiving ->
admitted, or cancelled / expired; calls that overtake the ones they follow; illegal moves."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

from decode_worker.handoffs import DecodeHandoffs
from engine.kv_cache.block_manager import BlockManager
from engine.messages import (
    CancelReservation,
    JoinChannel,
    PinChannel,
    PrefillResult,
    ReceiveKV,
    ReserveBlocks,
    SampleStart,
)
from engine.sampling.params import SamplingParams
from kv_transfer.channel_table import ChannelTable
from kv_transfer.messages import ChannelRendezvous, TransferTicket

BLOCK_SIZE = 4
T = TypeVar("T")


class _Engine:
    """``LLMEngine``'s reservation verbs over a real block manager (no model)."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.blocks = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        self.reserved: dict[str, list[int]] = {}
        self.running: set[str] = set()

    def reserve_blocks(
        self, request_id: str, num_tokens: int, prefix_hashes: Sequence[bytes] = ()
    ) -> list[int] | None:
        assert request_id not in self.reserved and request_id not in self.running
        assert not prefix_hashes  # (no prefix caching here)
        block_ids = self.blocks.reserve(num_tokens)
        if block_ids is not None:
            self.reserved[request_id] = block_ids
        return block_ids

    def num_shared_reserved(self, request_id: str) -> int:
        return 0

    def cancel_reservation(self, request_id: str) -> None:
        self.blocks.release(self.reserved.pop(request_id, []))

    def has_request(self, request_id: str) -> bool:
        return request_id in self.running


class _Loop:
    """``EngineLoop.call`` over ``engine`` (no thread, no lock: the tests make one call at once)."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    def call(self, fn: Callable[[_Engine], T]) -> T:
        return fn(self.engine)


class _Channel:
    """Stands in for a KVChannel: the table only holds channels and closes them."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _channel() -> Any:  # a KVChannel, as far as the table goes
    return _Channel()


def _handoffs(
    engine: _Engine,
    channels: ChannelTable | None = None,
    *,
    ttl_s: float = 10.0,
    capacity: int = 4096,
    clock: Callable[[], float] = time.monotonic,
) -> DecodeHandoffs:
    table = channels if channels is not None else ChannelTable(max_channels=4)
    return DecodeHandoffs(_Loop(engine), table, ttl_s, capacity=capacity, clock=clock)


def _receive(request_id: str, handoff_id: str, channel_id: str = "c") -> ReceiveKV:
    start = SampleStart(0, 7, None, None, None)
    result = PrefillResult(request_id, [1] * 8, SamplingParams(), None, (start,), [0, 1], 0)
    ticket = TransferTicket(0, request_id, 2, timeout_s=1.0)
    return ReceiveKV(channel_id, handoff_id, result, ticket, [0, 1], "g", "fail")


def _join(channel_id: str, request_id: str, handoff_id: str) -> JoinChannel:
    return JoinChannel(
        ChannelRendezvous("fake", channel_id, "127.0.0.1", 0), request_id, handoff_id
    )


def test_a_hand_off_goes_reserved_pinned_receiving_admitted() -> None:
    engine, table = _Engine(), ChannelTable(max_channels=4)
    handoffs = _handoffs(engine, table)
    reservation = handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    assert reservation is not None and len(reservation.block_ids) == 2
    assert reservation.channel_id is None and handoffs.state("r") == "reserved"
    channel = _channel()
    assert handoffs.join(_join("c", "r", "h1"), channel)
    assert handoffs.state("r") == "pinned" and table.num_pins == 1
    assert handoffs.begin_receive(_receive("r", "h1")) == (channel, "receive")
    assert handoffs.state("r") == "receiving" and table.num_pins == 0  # the pin is the receive's
    assert handoffs.end_receive("r", keep_blocks=True)
    assert handoffs.state("r") is None
    assert engine.reserved["r"] == reservation.block_ids  # kept for the admission
    assert table.release("c") == []


def test_a_reserve_naming_an_open_channel_pins_it_and_one_not_open_does_not() -> None:
    table = ChannelTable(max_channels=4)
    table.add("open", _channel())
    handoffs = _handoffs(_Engine(), table)
    pinned = handoffs.reserve(ReserveBlocks("r", "h1", 4, "open"))
    assert pinned is not None and pinned.channel_id == "open" and handoffs.state("r") == "pinned"
    unpinned = handoffs.reserve(ReserveBlocks("s", "h2", 4, "gone"))
    assert unpinned is not None and unpinned.channel_id is None
    assert handoffs.state("s") == "reserved" and table.num_pins == 1


def test_a_full_cache_refuses_a_reserve_and_keeps_nothing() -> None:
    engine = _Engine(num_blocks=2)
    handoffs = _handoffs(engine)
    assert handoffs.reserve(ReserveBlocks("r", "h1", 9, None)) is None  # 3 blocks
    assert handoffs.state("r") is None and engine.blocks.num_free_blocks == 2


def test_a_cancel_gives_the_blocks_and_the_pin_back() -> None:
    engine, table = _Engine(), ChannelTable(max_channels=4)
    table.add("c", _channel())
    handoffs = _handoffs(engine, table)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, "c"))
    handoffs.cancel(CancelReservation("r", "h1"))
    assert handoffs.state("r") is None and table.num_pins == 0
    assert engine.blocks.num_free_blocks == 8


def test_a_cancel_that_overtakes_its_reserve_refuses_it_once() -> None:
    engine = _Engine()
    handoffs = _handoffs(engine)
    handoffs.cancel(CancelReservation("r", "h1"))
    assert handoffs.reserve(ReserveBlocks("r", "h1", 8, None)) is None
    assert engine.blocks.num_free_blocks == 8
    assert handoffs.reserve(ReserveBlocks("r", "h2", 8, None)) is not None  # a later try


def test_a_reservation_answers_to_its_own_hand_off_only() -> None:
    table = ChannelTable(max_channels=4)
    table.add("c", _channel())
    engine = _Engine()
    handoffs = _handoffs(engine, table)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    assert not handoffs.pin(PinChannel("r", "h0", "c"))
    handoffs.cancel(CancelReservation("r", "h0"))  # an earlier try's late cancel
    assert handoffs.state("r") == "reserved" and "r" in engine.reserved
    assert handoffs.begin_receive(_receive("r", "h0"))[1] == "discard"
    assert handoffs.state("r") == "reserved"
    assert handoffs.pin(PinChannel("r", "h1", "c")) and handoffs.state("r") == "pinned"


def test_a_pin_moves_to_another_open_channel_and_not_to_a_closed_one() -> None:
    table = ChannelTable(max_channels=1)
    a, b = _channel(), _channel()
    table.add("a", a)
    handoffs = _handoffs(_Engine(), table)
    handoffs.reserve(ReserveBlocks("r", "h1", 4, "a"))
    assert not handoffs.pin(PinChannel("r", "h1", "gone"))
    assert table.add("b", b) == []  # "a" is pinned: over the cap for now
    assert handoffs.pin(PinChannel("r", "h1", "b"))
    assert table.add("c", _channel()) == [a]  # "a" is idle now; "b" is pinned


def test_channel_pins_keep_the_cap_from_closing_a_channel_a_transfer_is_coming_on() -> None:
    table = ChannelTable(max_channels=1)
    handoffs = _handoffs(_Engine(), table)
    handoffs.reserve(ReserveBlocks("r", "h1", 4, None))
    a = _channel()
    assert handoffs.join(_join("a", "r", "h1"), a)  # pinned as it opens
    assert not handoffs.join(_join("b", "", ""), _channel())  # for no hand-off
    assert "a" in table and "b" in table
    handoffs.cancel(CancelReservation("r", "h1"))
    assert "a" not in table and a.closed  # unpinned and idle over the cap: closed


def test_an_abort_during_the_receive_gives_the_blocks_back_after_it_lands() -> None:
    engine = _Engine()
    handoffs = _handoffs(engine)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    handoffs.begin_receive(_receive("r", "h1"))
    assert handoffs.abort("r")  # the caller leaves the engine alone for now
    assert handoffs.state("r") == "dropping" and "r" in engine.reserved
    assert handoffs.abort("r")  # again: still waiting for the transfer
    assert not handoffs.end_receive("r", keep_blocks=True)
    assert handoffs.state("r") is None and engine.blocks.num_free_blocks == 8


def test_an_abort_before_the_transfer_cancels_the_reservation() -> None:
    engine, table = _Engine(), ChannelTable(max_channels=4)
    table.add("c", _channel())
    handoffs = _handoffs(engine, table)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, "c"))
    assert not handoffs.abort("r")  # the caller aborts it in the engine
    assert handoffs.state("r") is None and table.num_pins == 0
    assert engine.blocks.num_free_blocks == 8


def test_an_abort_that_overtakes_its_hand_off_drops_it_when_it_arrives() -> None:
    engine = _Engine()
    handoffs = _handoffs(engine)
    assert not handoffs.abort("r")
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))  # the reserve still comes
    assert handoffs.begin_receive(_receive("r", "h1"))[1] == "discard"
    assert handoffs.state("r") is None and engine.blocks.num_free_blocks == 8
    assert not handoffs.abort("s")
    assert not handoffs.arrive_without_kv("s")  # a hand-off without KV is dropped too
    assert handoffs.arrive_without_kv("s")  # once


def test_an_abort_of_a_request_running_here_is_not_kept_for_a_hand_off() -> None:
    engine = _Engine()
    engine.running.add("r")
    handoffs = _handoffs(engine)
    assert not handoffs.abort("r")
    assert handoffs.arrive_without_kv("r")


def test_a_submission_here_gives_a_waiting_reservation_back_and_forgets_an_early_abort() -> None:
    engine = _Engine()
    handoffs = _handoffs(engine)
    handoffs.abort("r")
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    handoffs.submitted("r")
    assert handoffs.state("r") is None and engine.blocks.num_free_blocks == 8
    assert handoffs.arrive_without_kv("r")  # the early abort is forgotten


def test_a_reservation_whose_transfer_never_comes_expires() -> None:
    engine, table, clock = _Engine(), ChannelTable(max_channels=4), _Clock()
    table.add("c", _channel())
    handoffs = _handoffs(engine, table, ttl_s=1.0, clock=clock)
    handoffs.reserve(ReserveBlocks("old", "h1", 4, "c"))
    clock.now = 0.6
    handoffs.reserve(ReserveBlocks("new", "h2", 4, None))
    handoffs.reserve(ReserveBlocks("busy", "h3", 4, None))
    handoffs.begin_receive(_receive("busy", "h3"))
    clock.now = 1.5
    assert handoffs.expire() == ["old"]  # a receive under way never expires
    assert table.num_pins == 0 and "old" not in engine.reserved
    assert handoffs.state("new") == "reserved" and handoffs.state("busy") == "receiving"
    assert handoffs.begin_receive(_receive("old", "h1"))[1] == "expired"
    assert handoffs.begin_receive(_receive("old", "h1"))[1] == "discard"  # told once


def test_a_receive_ending_with_the_kv_missing_gives_the_blocks_back() -> None:
    engine = _Engine()
    handoffs = _handoffs(engine)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    handoffs.begin_receive(_receive("r", "h1"))
    assert handoffs.end_receive("r", keep_blocks=False)  # still wanted: recompute or fail it
    assert engine.blocks.num_free_blocks == 8


def test_a_receive_on_another_channel_than_the_pinned_one_ends_the_pin() -> None:
    table = ChannelTable(max_channels=1)
    a, b = _channel(), _channel()
    table.add("a", a)
    handoffs = _handoffs(_Engine(), table)
    handoffs.reserve(ReserveBlocks("r", "h1", 4, "a"))
    table.add("b", b)
    assert handoffs.begin_receive(_receive("r", "h1", "b")) == (b, "receive")
    assert table.num_pins == 0
    assert table.release("b") == [a]  # both idle: the least recently used goes


@pytest.mark.parametrize("state", ["receiving", "dropping"])
def test_illegal_moves_while_the_kv_arrives(state: str) -> None:
    engine = _Engine()
    table = ChannelTable(max_channels=4)
    table.add("c", _channel())
    handoffs = _handoffs(engine, table)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    handoffs.begin_receive(_receive("r", "h1"))
    if state == "dropping":
        handoffs.abort("r")
    with pytest.raises(ValueError, match="request_id 'r' is already in use"):
        handoffs.reserve(ReserveBlocks("r", "h2", 8, None))
    with pytest.raises(ValueError, match="already receiving its KV here"):
        handoffs.submitted("r")
    assert not handoffs.pin(PinChannel("r", "h1", "c"))
    assert not handoffs.join(_join("d", "r", "h1"), _channel())
    handoffs.cancel(CancelReservation("r", "h1"))  # the receive owns the blocks now
    assert handoffs.begin_receive(_receive("r", "h1"))[1] == "discard"  # a second receive
    assert handoffs.expire() == []
    assert handoffs.state("r") == state and "r" in engine.reserved
    assert table.num_pins == 0


def test_a_receive_ends_only_once_and_only_after_it_began() -> None:
    handoffs = _handoffs(_Engine())
    with pytest.raises(RuntimeError, match="no receive of 'r' is under way"):
        handoffs.end_receive("r", keep_blocks=True)
    handoffs.reserve(ReserveBlocks("r", "h1", 8, None))
    with pytest.raises(RuntimeError, match="no receive of 'r' is under way"):
        handoffs.end_receive("r", keep_blocks=True)
    handoffs.begin_receive(_receive("r", "h1"))
    handoffs.end_receive("r", keep_blocks=True)
    with pytest.raises(RuntimeError, match="no receive of 'r' is under way"):
        handoffs.end_receive("r", keep_blocks=True)


def test_the_oldest_remembered_calls_are_forgotten_beyond_the_capacity() -> None:
    handoffs = _handoffs(_Engine(), capacity=3)
    for request_id in "abcd":
        handoffs.abort(request_id)
    handoffs.abort("b")  # aborted again: now the newest
    handoffs.abort("e")
    arrivals = [handoffs.arrive_without_kv(r) for r in "abcde"]
    assert arrivals == [True, False, True, False, False]


def test_a_ttl_and_a_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        _handoffs(_Engine(), ttl_s=0.0)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        _handoffs(_Engine(), capacity=0)


def test_the_state_machine_imports_without_torch() -> None:
    code = "import sys, decode_worker.handoffs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
