"""Each hand-off's state on a decode worker, from its reserve to its admission.

A hand-off is one prefill worker's try at moving one request's KV here; every call of it carries
its own ``handoff_id``. While it lives here it is, by request id (one at a time per request):
  reserved   -- blocks hold a place for the prompt's KV (the engine keeps them by request)
  pinned     -- and the channel its KV comes on is pinned open (the cap does not close it)
  receiving  -- the KV is arriving into the blocks
  dropping   -- aborted while receiving: the blocks go back once the transfer has landed (the
                channel must stay in step with the sender)
It ends admitted (its receive ended with the request still wanted: the caller admits it at once,
and the engine adopts the blocks), cancelled (the prefill worker gave up before the transfer, or
the request was aborted or submitted here: blocks and pin go back) or expired (no transfer
within ``ttl_s``: its prefill worker died or gave up without a word).

A call may overtake the one it follows; what came first is remembered until the other comes:
  a cancel that comes before its reserve refuses that reserve;
  an abort that comes before its hand-off drops the hand-off when it arrives;
  a reservation that expired fails a transfer that still comes (the router places it again).
Beyond ``capacity`` of each the oldest are forgotten: ids are never reused, and a call trails
the one it overtook by seconds at most.

Not thread-safe: the decode worker makes every call under its engine loop's lock, since each
transition reserves, frees or reads the engine's blocks and must be atomic with the engine's
steps. The engine is reached through the loop's ``call`` (re-entrant under that lock), which
keeps the loop's load report current. The channel table's own lock is taken inside the loop's,
never the other way round.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from engine.messages import (
    CancelReservation,
    JoinChannel,
    PinChannel,
    ReceiveKV,
    Reservation,
    ReserveBlocks,
)
from kv_transfer.channel_table import ChannelTable, WorkerChannel, close_channels

HandoffState = Literal["reserved", "pinned", "receiving", "dropping"]
# how a receive starts: into the reservation, or the bytes dropped (the reservation is gone, or
# it expired, when the request fails for the router to place again)
ReceiveStart = Literal["receive", "discard", "expired"]
_WAITING: tuple[HandoffState, ...] = ("reserved", "pinned")  # no transfer has begun
_RECEIVING: tuple[HandoffState, ...] = ("receiving", "dropping")
T = TypeVar("T")


class ReservingEngine(Protocol):
    """What the hand-offs need of the engine (``LLMEngine``): blocks reserved by request."""

    def reserve_blocks(
        self, request_id: str, num_tokens: int, prefix_hashes: Sequence[bytes] = ()
    ) -> list[int] | None: ...

    def num_shared_reserved(self, request_id: str) -> int: ...

    def cancel_reservation(self, request_id: str) -> None: ...

    def has_request(self, request_id: str) -> bool: ...


class EngineCalls(Protocol):
    """How the hand-offs reach the engine: ``EngineLoop.call``."""

    def call(self, fn: Callable[[ReservingEngine], T]) -> T: ...


@dataclass(slots=True)
class _Handoff:
    handoff_id: str  # the hand-off holding the request's reservation
    reserved_at: float  # when, on the clock of ``DecodeHandoffs``
    state: HandoffState = "reserved"  # where it stands (see the module's docstring)


class DecodeHandoffs:
    """Every hand-off under way on one decode worker, and the calls that overtook theirs."""

    def __init__(
        self,
        engine: EngineCalls,
        channels: ChannelTable,
        ttl_s: float,
        *,
        capacity: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._engine = engine
        self._channels = channels
        self._clock = clock
        self._live: dict[str, _Handoff] = {}  # request id -> its hand-off under way here
        self._cancelled = _RecentIds(capacity)  # hand-offs cancelled before their reserve came
        self._aborted = _RecentIds(capacity)  # requests aborted before their hand-off came
        self._expired = _RecentIds(capacity)  # requests whose reservation expired

    def state(self, request_id: str) -> HandoffState | None:
        """Where the request's hand-off stands here; None when none is under way."""
        handoff = self._live.get(request_id)
        return None if handoff is None else handoff.state

    # ---- the prefill worker's calls -----------------------------------------------------
    def reserve(self, call: ReserveBlocks) -> Reservation | None:
        """reserved (pinned, when ``call.channel_id`` is open here); None when the blocks do
        not fit now or the hand-off was cancelled already. ValueError when the request has a
        hand-off under way, or runs, here."""
        if self._cancelled.take(call.handoff_id):
            return None  # the prefill worker gave up on this hand-off already
        if call.request_id in self._live:
            raise ValueError(f"request_id {call.request_id!r} is already in use")
        request_id, num_tokens, hashes = call.request_id, call.num_tokens, call.prefix_hashes

        def reserve(engine: ReservingEngine) -> tuple[list[int] | None, int]:
            block_ids = engine.reserve_blocks(request_id, num_tokens, hashes)
            return block_ids, engine.num_shared_reserved(request_id)

        block_ids, num_shared = self._engine.call(reserve)
        if block_ids is None:
            return None
        handoff = self._live[call.request_id] = _Handoff(call.handoff_id, self._clock())
        channel_id = call.channel_id
        pinned = channel_id is not None and self._channels.pin(call.request_id, channel_id)
        if pinned:
            handoff.state = "pinned"
        return Reservation(block_ids, channel_id if pinned else None, num_shared)

    def pin(self, call: PinChannel) -> bool:
        """reserved/pinned -> pinned on ``call.channel_id``; False if that channel is not open
        here, or the hand-off holds no reservation waiting for its transfer."""
        handoff = self._waiting(call.request_id, call.handoff_id)
        if handoff is None or not self._channels.pin(call.request_id, call.channel_id):
            return False
        handoff.state = "pinned"
        return True

    def join(self, call: JoinChannel, channel: WorkerChannel) -> bool:
        """Open ``channel`` (joined for ``call``): reserved/pinned -> pinned on it; False (the
        channel open all the same, unpinned) when the hand-off holds no waiting reservation."""
        handoff = self._waiting(call.request_id, call.handoff_id)
        pin_for = None if handoff is None else call.request_id
        key = call.rendezvous.channel_id
        close_channels(self._channels.add(key, channel, pin_for=pin_for))
        if handoff is None:
            return False
        handoff.state = "pinned"
        return True

    def cancel(self, call: CancelReservation) -> None:
        """reserved/pinned -> cancelled. A cancel of a hand-off holding no waiting reservation
        is remembered instead: its reserve may come late, and is refused."""
        if self._waiting(call.request_id, call.handoff_id) is None:
            self._cancelled.add(call.handoff_id)
            return
        self._give_back(call.request_id)

    def begin_receive(self, call: ReceiveKV) -> tuple[WorkerChannel | None, ReceiveStart]:
        """reserved/pinned -> receiving, with the channel the KV comes on (in use until the
        caller's ``ChannelTable.release``; None when it is not open). Otherwise the bytes are to
        be dropped: the reservation is gone, or expired (the request is then to fail)."""
        request_id = call.result.request_id
        ours = self._waiting(request_id, call.handoff_id) is not None
        if ours:  # its pin, if any, passes to the receive
            channel = self._channels.take(request_id, call.channel_id)
        else:
            channel = self._use(call.channel_id)
        if self._aborted.take(request_id):  # the abort came before the hand-off
            self._drop(request_id)
        handoff = self._waiting(request_id, call.handoff_id)
        if handoff is not None:
            handoff.state = "receiving"
            return channel, "receive"
        return channel, "expired" if self._expired.take(request_id) else "discard"

    def end_receive(self, request_id: str, *, keep_blocks: bool) -> bool:
        """receiving -> admitted: True, the blocks kept for the caller's admission if
        ``keep_blocks`` (given back otherwise). dropping -> cancelled: False, blocks given
        back. RuntimeError when no receive of the request is under way."""
        handoff = self._live.get(request_id)
        if handoff is None or handoff.state not in _RECEIVING:
            raise RuntimeError(f"no receive of {request_id!r} is under way")
        del self._live[request_id]
        wanted = handoff.state == "receiving"
        if not (wanted and keep_blocks):
            self._cancel_reservation(request_id)
        return wanted

    def arrive_without_kv(self, request_id: str) -> bool:
        """A hand-off without KV (no blocks could be reserved) arrives; False when an abort
        came before it (then it is dropped)."""
        return not self._aborted.take(request_id)

    # ---- the router's calls -------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """receiving -> dropping: True, and the caller leaves the engine alone until the
        receive ends. Otherwise a waiting reservation is cancelled (an abort of a request not
        here yet is remembered for its hand-off), and the caller aborts it in the engine."""
        handoff = self._live.get(request_id)
        if handoff is not None and handoff.state in _RECEIVING:
            handoff.state = "dropping"
            return True
        if not self._engine.call(lambda engine: engine.has_request(request_id)):
            self._aborted.add(request_id)
        self._give_back(request_id)
        return False

    def submitted(self, request_id: str) -> None:
        """The request is to run here from its prompt (colocated, or resumed after a failure):
        a waiting reservation is cancelled, an abort remembered for it forgotten (the router
        aborts a request it submits directly only once the submission has returned).
        ValueError when its KV is arriving: each placement has its own id, so the same id twice
        at once is the caller's error."""
        handoff = self._live.get(request_id)
        if handoff is not None and handoff.state in _RECEIVING:
            raise ValueError(f"request_id {request_id!r} is already receiving its KV here")
        self._aborted.take(request_id)
        self._give_back(request_id)

    # ---- sweeps -------------------------------------------------------------------------
    def expire(self) -> list[str]:
        """reserved/pinned -> expired for every reservation older than ``ttl_s``; their
        requests (blocks and pins given back)."""
        now = self._clock()
        expired = [
            request_id
            for request_id, handoff in self._live.items()
            if handoff.state in _WAITING and now - handoff.reserved_at > self.ttl_s
        ]
        for request_id in expired:
            self._give_back(request_id)
            self._expired.add(request_id)
        return expired

    # ---- transitions' parts -------------------------------------------------------------
    def _waiting(self, request_id: str, handoff_id: str) -> _Handoff | None:
        """The request's hand-off, if it is ``handoff_id`` and no transfer has begun."""
        handoff = self._live.get(request_id)
        if handoff is None or handoff.handoff_id != handoff_id or handoff.state not in _WAITING:
            return None
        return handoff

    def _use(self, channel_id: str) -> WorkerChannel | None:
        """The open channel ``channel_id``, in use for a receive that has no pin on it."""
        channel = self._channels.get(channel_id)
        if channel is None or not self._channels.use(channel_id, channel):
            return None
        return channel

    def _drop(self, request_id: str) -> None:
        """An abort of the request reaches its hand-off: dropping if receiving, else cancelled."""
        handoff = self._live.get(request_id)
        if handoff is not None and handoff.state in _RECEIVING:
            handoff.state = "dropping"
        else:
            self._give_back(request_id)

    def _give_back(self, request_id: str) -> None:
        """reserved/pinned -> cancelled: the blocks and the channel's pin go back."""
        handoff = self._live.get(request_id)
        if handoff is None or handoff.state not in _WAITING:
            return
        del self._live[request_id]
        close_channels(self._channels.unpin(request_id))
        self._cancel_reservation(request_id)

    def _cancel_reservation(self, request_id: str) -> None:
        self._engine.call(lambda engine: engine.cancel_reservation(request_id))


class _RecentIds:
    """Ids remembered until taken, the oldest forgotten beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, id_: str) -> None:
        self._ids[id_] = None
        self._ids.move_to_end(id_)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def take(self, id_: str) -> bool:
        """Whether ``id_`` was remembered; it is forgotten either way."""
        if id_ not in self._ids:
            return False
        del self._ids[id_]
        return True
