"""The interface every transport implements; `KVChannel` is the only caller.

Lifecycle of an endpoint: built by its transport's listener (`accept`) or `connect` once the
handshake passed → `send` (sender end) or `recv` (receiver end), one transfer at a time →
`abort` (any thread, unblocks what it can) → `close` (releases sockets, process groups,
shared memory; called once, by the thread that owns the channel lock).

Endpoints raise `TimeoutError` when the deadline passes, `ConnectionError` / `OSError` /
`RuntimeError` when the link or the peer fails, and `TransferError` for protocol, ticket or
checksum failures. `KVChannel` turns all of these into `TransferError`s with the ticket's ids.
Validation of the caller's arguments happens before, in `KVChannel`.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.chunking import BlockIds
from kv_transfer.deadline import Deadline
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous, TransferStats, TransferTicket


@dataclass(frozen=True, slots=True)
class Move:
    """One transfer as an endpoint sees it, arguments already checked."""

    kv_cache: torch.Tensor  # the worker's whole cache, matching the channel layout
    block_ids: BlockIds  # the transfer's block ids, checked against the cache
    ticket: TransferTicket
    deadline: Deadline


@dataclass(slots=True)
class PhaseTimer:
    """Accumulates seconds per phase of one transfer, for `TransferStats`."""

    start: float = field(default_factory=time.perf_counter)
    gather_s: float = 0.0
    wire_s: float = 0.0
    scatter_s: float = 0.0
    checksum_s: float = 0.0

    def stats(self, ticket: TransferTicket, nbytes: int, num_chunks: int) -> TransferStats:
        return TransferStats(
            transfer_id=ticket.transfer_id,
            nbytes=nbytes,
            num_chunks=num_chunks,
            gather_s=self.gather_s,
            wire_s=self.wire_s,
            scatter_s=self.scatter_s,
            checksum_s=self.checksum_s,
            total_s=time.perf_counter() - self.start,
        )


class Endpoint(abc.ABC):
    """One end of an established channel."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    @abc.abstractmethod
    def send(self, move: Move) -> TransferStats:
        """Gather `move.block_ids` and deliver them; return once the receiver confirmed."""

    @abc.abstractmethod
    def recv(self, move: Move) -> TransferStats:
        """Receive one transfer and scatter it into `move.block_ids`."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Best effort: make a blocked send/recv in another thread fail soon. Idempotent."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource. Idempotent; never called while send/recv runs."""


class ListenerBackend(abc.ABC):
    """A transport's listening half: created first, on the sender."""

    rendezvous: ChannelRendezvous

    @abc.abstractmethod
    def accept(self, deadline: Deadline) -> Endpoint:
        """Wait for the receiver; return the sender endpoint once the handshake passed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening. Idempotent."""
