"""The calls a worker's rank 0 makes on one rank's KV port (its own, or a follower rank's).

A hand-off between workers of several tensor-parallel ranks runs one channel per rank pair of
``kv_transfer.head_plan.plan_head_moves``; each channel's ends live in the processes of its two
ranks, beside their KV caches. Rank 0 of each worker drives its ranks' ends with these calls:
  ListenPair   -- a prefill rank starts listening for a pair's channel (answers its rendezvous)
  AcceptPair   -- and waits until the decode rank joined and the handshake passed
  ConnectPair  -- a decode rank joins a pair's channel
  SendPair     -- a prefill rank sends its heads of some blocks on the pair's channel
  RecvPair     -- a decode rank receives them into its blocks
  DiscardPair  -- a decode rank receives them into scratch and drops them
  ClosePair    -- either end closes the pair's channel (or stops listening)
A follower rank answers them through its Ray actor (``router.actors.RankActor.kv``), rank 0
through a local peer; both are a ``RankPeer``. Torch-free: the router imports this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kv_transfer.messages import ChannelRendezvous, TransferStats, TransferTicket

Answer = TypeVar("Answer", covariant=True)
T = TypeVar("T")


class RankCall(ABC, Generic[Answer]):
    """A call on one rank's KV port; ``Answer`` is what it answers."""

    __slots__ = ()

    @abstractmethod
    def run_on(self, port: RankPort) -> Answer:
        """Answers this call: its verb of ``port``."""


@dataclass(frozen=True, slots=True)
class ListenPair(RankCall[ChannelRendezvous]):
    """Starts listening for a pair's channel that sends ``heads`` of this rank's cache."""

    transport: str  # the channel's transport
    channel_id: str  # the pair's channel, unique on this rank
    heads: range  # the model's KV heads the channel moves

    def run_on(self, port: RankPort) -> ChannelRendezvous:
        return port.listen(self)


@dataclass(frozen=True, slots=True)
class AcceptPair(RankCall[None]):
    """Waits until the decode rank joined the pair's channel and the handshake passed."""

    channel_id: str  # a channel this rank listens for
    timeout_s: float  # how long to wait

    def run_on(self, port: RankPort) -> None:
        port.accept(self)


@dataclass(frozen=True, slots=True)
class ConnectPair(RankCall[None]):
    """Joins a pair's channel, receiving ``heads`` into this rank's cache."""

    rendezvous: ChannelRendezvous  # the listening prefill rank's
    heads: range  # the model's KV heads the channel moves
    timeout_s: float  # how long the joining may take

    def run_on(self, port: RankPort) -> None:
        port.connect(self)


@dataclass(frozen=True, slots=True)
class SendPair(RankCall[TransferStats]):
    """Sends the pair's heads of ``block_ids`` of this rank's cache."""

    channel_id: str  # the pair's channel
    block_ids: list[int]  # this worker's blocks (the same ids on every rank)
    ticket: TransferTicket  # the transfer, as both ends run it

    def run_on(self, port: RankPort) -> TransferStats:
        return port.send(self)


@dataclass(frozen=True, slots=True)
class RecvPair(RankCall[TransferStats]):
    """Receives the pair's heads into ``block_ids`` of this rank's cache."""

    channel_id: str  # the pair's channel
    block_ids: list[int]  # this worker's reserved blocks (the same ids on every rank)
    ticket: TransferTicket  # the transfer, as both ends run it

    def run_on(self, port: RankPort) -> TransferStats:
        return port.recv(self)


@dataclass(frozen=True, slots=True)
class DiscardPair(RankCall[TransferStats]):
    """Receives a transfer into scratch blocks and drops it (its request went away)."""

    channel_id: str  # the pair's channel
    ticket: TransferTicket  # the transfer, as the sender runs it

    def run_on(self, port: RankPort) -> TransferStats:
        return port.discard(self)


@dataclass(frozen=True, slots=True)
class ClosePair(RankCall[None]):
    """Closes the pair's channel, or stops listening for it (waking a waiting accept)."""

    channel_id: str  # the pair's channel

    def run_on(self, port: RankPort) -> None:
        port.close(self)


class RankPort(Protocol):
    """One rank's end of its pair channels: one verb per call."""

    def listen(self, call: ListenPair) -> ChannelRendezvous: ...

    def accept(self, call: AcceptPair) -> None: ...

    def connect(self, call: ConnectPair) -> None: ...

    def send(self, call: SendPair) -> TransferStats: ...

    def recv(self, call: RecvPair) -> TransferStats: ...

    def discard(self, call: DiscardPair) -> TransferStats: ...

    def close(self, call: ClosePair) -> None: ...


class RankPeer(Protocol):
    """How rank 0 reaches one rank's port: a follower's Ray actor, or its own port."""

    def send(self, call: RankCall[T]) -> Future[T]:
        """Sends ``call`` to the rank; its answer comes in the future."""
        ...
