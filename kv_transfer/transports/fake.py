"""`fake` transport: an in-process pair for unit tests of worker code.

Lifecycle: `FakeListener` registers its channel id in this process → `connect_fake` finds it,
checks token and layout (a mismatch raises `LayoutMismatchError` here and in the listener's
`accept`), builds a `FakeLink` and leaves the sender end for `accept` → transfers: the sender
gathers into a fresh tensor, hands it over and blocks until the receiver scattered it and
answered (so a receiver that never comes makes the sender time out, as on a real wire) →
`abort` / `close` break the link: the peer's next wait fails at once. A parcel not yet taken
when its sender gives up (timeout, abort, close) is withdrawn, so a late receiver fails as it
would on a torn-down wire instead of landing a transfer nobody waits for.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.checksum import StreamingCrc32
from kv_transfer.chunking import Chunk, chunk_view, gather_chunk, heads_view, scatter_chunk
from kv_transfer.deadline import Deadline
from kv_transfer.errors import LayoutMismatchError, ProtocolError, TransferError
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous, TransferStats, TransferTicket
from kv_transfer.transports.base import Endpoint, ListenerBackend, Move, PhaseTimer


@dataclass(frozen=True, slots=True)
class _Parcel:
    ticket: TransferTicket  # the sender's ticket
    payload: torch.Tensor  # uint8, the gathered blocks
    crc: int | None  # the sender's checksum, when asked for


class FakeLink:
    """What two fake endpoints share: one parcel in flight and the receiver's answer."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.parcel: _Parcel | None = None
        self.answer: str | None = None  # "" = ok, else the receiver's reason for failing
        self.broken = False

    def wait_for(self, ready: Callable[[], bool], deadline: Deadline, what: str) -> None:
        """Wait (holding `changed`) until `ready()` or broken; TimeoutError at the deadline."""
        if not self.changed.wait_for(lambda: self.broken or ready(), deadline.remaining()):
            raise TimeoutError(f"deadline passed while {what}")
        if not ready():  # broken; an answer that arrived before the break still counts
            raise ConnectionError("the peer closed the fake channel")

    def break_link(self) -> None:
        """Fail every wait on the link; a parcel still in flight is lost with it."""
        with self.changed:
            self.broken = True
            self.parcel = None
            self.changed.notify_all()


class FakeEndpoint(Endpoint):
    def __init__(self, layout: KVCacheLayout, link: FakeLink) -> None:
        super().__init__(layout)
        self._link = link

    def _chunk(self, num_blocks: int) -> Chunk:
        num_planes = self.layout.num_planes
        return Chunk(0, num_planes, 0, num_blocks, num_blocks * self.layout.moved_block_nbytes)

    def send(self, move: Move) -> TransferStats:
        timer, chunk = PhaseTimer(), self._chunk(move.ticket.num_blocks)
        payload = torch.empty(chunk.nbytes, dtype=torch.uint8, device=move.kv_cache.device)
        planes = heads_view(move.kv_cache, self.layout)
        gather_chunk(planes, move.block_ids, chunk, chunk_view(payload, chunk, self.layout))
        timer.gather_s = time.perf_counter() - timer.start
        crc = _crc(payload, timer) if move.ticket.checksum else None
        link, start = self._link, time.perf_counter()
        with link.changed:
            link.wait_for(lambda: link.parcel is None, move.deadline, "waiting for a free link")
            parcel = _Parcel(move.ticket, payload, crc)
            link.parcel, link.answer = parcel, None
            link.changed.notify_all()
            try:
                link.wait_for(
                    lambda: link.answer is not None, move.deadline, "waiting for the receiver"
                )
            except BaseException:
                if link.parcel is parcel:  # not taken yet: withdraw it, still holding the lock
                    link.parcel = None
                raise
            answer, link.answer = link.answer, None
        timer.wire_s = time.perf_counter() - start
        if answer:
            raise TransferError(f"the receiver failed the transfer: {answer}")
        return timer.stats(move.ticket, chunk.nbytes, 1)

    def recv(self, move: Move) -> TransferStats:
        timer, link = PhaseTimer(), self._link
        with link.changed:
            link.wait_for(lambda: link.parcel is not None, move.deadline, "waiting for the sender")
            parcel, link.parcel = link.parcel, None
        timer.wire_s = time.perf_counter() - timer.start
        assert parcel is not None
        try:
            self._land(parcel, move, timer)
        except TransferError as exc:
            self._answer(str(exc))
            raise
        self._answer("")
        return timer.stats(move.ticket, parcel.payload.numel(), 1)

    def _land(self, parcel: _Parcel, move: Move, timer: PhaseTimer) -> None:
        theirs, ours = parcel.ticket, move.ticket
        if (theirs.transfer_id, theirs.num_blocks, theirs.checksum) != (
            ours.transfer_id,
            ours.num_blocks,
            ours.checksum,
        ):
            raise ProtocolError(
                f"the sender started {theirs.label} ({theirs.num_blocks} blocks), "
                f"the receiver expects {ours.label} ({ours.num_blocks} blocks)"
            )
        chunk, planes = self._chunk(ours.num_blocks), heads_view(move.kv_cache, self.layout)
        start = time.perf_counter()
        scatter_chunk(planes, move.block_ids, chunk, chunk_view(parcel.payload, chunk, self.layout))
        timer.scatter_s = time.perf_counter() - start
        if parcel.crc is not None:  # read back what landed in the cache
            readback = torch.empty_like(parcel.payload, device=move.kv_cache.device)
            gather_chunk(planes, move.block_ids, chunk, chunk_view(readback, chunk, self.layout))
            crc = _crc(readback, timer)
            if crc != parcel.crc:
                raise TransferError(f"checksum mismatch: sender {parcel.crc:#x}, received {crc:#x}")

    def _answer(self, answer: str) -> None:
        with self._link.changed:
            self._link.answer = answer
            self._link.changed.notify_all()

    def abort(self) -> None:
        self._link.break_link()

    def close(self) -> None:
        self._link.break_link()


def _crc(payload: torch.Tensor, timer: PhaseTimer) -> int:
    start, crc = time.perf_counter(), StreamingCrc32()
    crc.update(payload)
    timer.checksum_s += time.perf_counter() - start
    return crc.value


class FakeListener(ListenerBackend):
    """Waits in this process for `connect_fake` with its rendezvous."""

    def __init__(self, layout: KVCacheLayout, host: str, channel_id: str) -> None:
        self.layout = layout
        token = secrets.token_hex(16)
        self.rendezvous = ChannelRendezvous("fake", channel_id, host, 0, (("token", token),))
        self._arrived = threading.Condition()
        self._outcome: Endpoint | LayoutMismatchError | None = None
        self._closed = False
        with _REGISTRY_LOCK:
            if channel_id in _REGISTRY:
                raise ValueError(f"a fake channel {channel_id!r} is already listening")
            _REGISTRY[channel_id] = self

    def offer(self, layout: KVCacheLayout) -> Endpoint:
        """Called by the receiver: check the layouts, leave the sender end, return ours."""
        with self._arrived:
            if self._outcome is not None:
                raise TransferError(f"fake channel {self.rendezvous.channel_id!r} is taken")
            reason = self.layout.mismatch(layout, "sender")
            if reason is not None:
                self._outcome = LayoutMismatchError(reason)
                self._arrived.notify_all()
                layout.check_compatible(self.layout, "receiver")
            link = FakeLink()
            self._outcome = FakeEndpoint(self.layout, link)
            self._arrived.notify_all()
            return FakeEndpoint(layout, link)

    def accept(self, deadline: Deadline) -> Endpoint:
        with self._arrived:
            arrived = self._arrived.wait_for(
                lambda: self._outcome is not None or self._closed, deadline.remaining()
            )
            if self._outcome is None and self._closed:
                raise ConnectionError("the listener was closed")
            if not arrived:
                raise TimeoutError("deadline passed while waiting for the receiver to connect")
            outcome = self._outcome
        if isinstance(outcome, LayoutMismatchError):
            raise outcome
        assert outcome is not None
        return outcome

    def close(self) -> None:
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.rendezvous.channel_id) is self:
                del _REGISTRY[self.rendezvous.channel_id]
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()


# The in-process "network": listening fake channels by id (the fake's only global).
_REGISTRY: dict[str, FakeListener] = {}
_REGISTRY_LOCK = threading.Lock()


def connect_fake(rendezvous: ChannelRendezvous, layout: KVCacheLayout) -> Endpoint:
    with _REGISTRY_LOCK:
        listener = _REGISTRY.get(rendezvous.channel_id)
    if listener is None or listener.rendezvous != rendezvous:
        raise ConnectionError(f"no fake channel {rendezvous.channel_id!r} listens in this process")
    return listener.offer(layout)
