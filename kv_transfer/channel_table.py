"""A worker's open KV channels, by key: which are in use, which are pinned open for a coming
transfer, and which close when the count is over the cap.

A prefill worker keys its channels by decode worker (one each), a decode worker by channel id
(one per prefill worker that sends to it). A channel is in use while a transfer runs on it. On
the decode side it is also pinned for a request whose KV is on the way on it (closing it would
leave the sender writing to a closed end); when pins start and end is the hand-off's state
machine's to say (decode_worker/handoffs.py). Only channels neither in use nor pinned close
over the cap, least recently used first: when one opens, and when one stops being used (so the
count comes back under the cap at rest). Each channel holds buffers, and on GPUs an NCCL
communicator of 50-100 MB. Thread-safe; torch-free (it only holds channels).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kv_transfer.messages import ChannelRendezvous, TransferStats, TransferTicket

if TYPE_CHECKING:
    import torch


class WorkerChannel(Protocol):
    """A worker's channel to another worker: a ``kv_transfer.channel.KVChannel`` between two
    workers of one rank each, or a ``kv_transfer.ranked_channel.RankedChannel`` of rank pairs."""

    rendezvous: ChannelRendezvous

    @property
    def broken(self) -> bool: ...

    def send_blocks(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats: ...

    def recv_blocks(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats: ...

    def discard(self, like: torch.Tensor, ticket: TransferTicket) -> TransferStats: ...

    def close(self) -> None: ...


class ChannelTable:
    def __init__(self, max_channels: int) -> None:
        self.max_channels = max_channels
        self._channels: OrderedDict[str, WorkerChannel] = OrderedDict()  # least recently used first
        self._users: Counter[str] = Counter()  # key -> transfers on its channel, and pins
        self._pins: dict[str, str] = {}  # request id -> key of the channel pinned for its KV
        self._lock = threading.Lock()

    def add(
        self, key: str, channel: WorkerChannel, *, in_use: bool = False, pin_for: str | None = None
    ) -> list[WorkerChannel]:
        """Open ``channel`` under ``key``: in use until ``release`` if ``in_use``, pinned for
        request ``pin_for`` if given. The channels the caller must close (one it replaces, idle
        ones over the cap)."""
        with self._lock:
            previous = self._channels.pop(key, None)
            self._channels[key] = channel
            if in_use:
                self._users[key] += 1
            if pin_for is not None:
                self._pin_locked(pin_for, key)
            closing = self._over_cap_locked(keep=key)
        return [*([previous] if previous is not None else []), *closing]

    def get(self, key: str) -> WorkerChannel | None:
        with self._lock:
            return self._channels.get(key)

    def use(self, key: str, channel: WorkerChannel) -> bool:
        """Mark ``channel`` in use until ``release``; False if it is no longer open under
        ``key`` (closed over the cap, or replaced)."""
        with self._lock:
            if self._channels.get(key) is not channel:
                return False
            self._users[key] += 1
            self._channels.move_to_end(key)
            return True

    def pin(self, request_id: str, key: str) -> bool:
        """Keep the channel under ``key`` open for ``request_id``'s KV; False if none is open."""
        with self._lock:
            if key not in self._channels:
                return False
            self._pin_locked(request_id, key)
            return True

    def unpin(self, request_id: str) -> list[WorkerChannel]:
        """End a request's pin; the channels the caller must close (now idle over the cap)."""
        with self._lock:
            self._unpin_locked(request_id)
            return self._over_cap_locked()

    def take(self, request_id: str, key: str) -> WorkerChannel | None:
        """The channel for ``request_id``'s receive, in use until ``release``; None when it is
        not open. The request's pin passes to the receive."""
        with self._lock:
            channel = self._channels.get(key)
            if channel is not None and self._pins.get(request_id) == key:
                del self._pins[request_id]  # its count now stands for the receive
            else:
                self._unpin_locked(request_id)
                if channel is not None:
                    self._users[key] += 1
            if channel is not None:
                self._channels.move_to_end(key)
            return channel

    def release(self, key: str) -> list[WorkerChannel]:
        """A transfer on the channel under ``key`` (from ``take``, ``use`` or ``add``) has
        ended; the channels the caller must close (now idle over the cap)."""
        with self._lock:
            self._drop_user_locked(key)
            return self._over_cap_locked()

    def remove(self, key: str, channel: WorkerChannel) -> None:
        """Forget a broken channel (if still the one open under its key); the caller closes it."""
        with self._lock:
            if self._channels.get(key) is channel:
                del self._channels[key]

    def remove_all(self) -> list[WorkerChannel]:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        return channels

    def items(self) -> list[tuple[str, WorkerChannel]]:
        with self._lock:
            return list(self._channels.items())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._channels

    def __len__(self) -> int:
        with self._lock:
            return len(self._channels)

    @property
    def num_pins(self) -> int:
        with self._lock:
            return len(self._pins)

    def _pin_locked(self, request_id: str, key: str) -> None:
        self._unpin_locked(request_id)
        self._pins[request_id] = key
        self._users[key] += 1
        self._channels.move_to_end(key)

    def _over_cap_locked(self, keep: str | None = None) -> list[WorkerChannel]:
        """Take idle channels out (but ``keep``) while over the cap, least recently used first."""
        excess = len(self._channels) - self.max_channels
        if excess <= 0:
            return []
        idle = [key for key in self._channels if key != keep and not self._users[key]]
        return [self._channels.pop(key) for key in idle[:excess]]

    def _unpin_locked(self, request_id: str) -> None:
        key = self._pins.pop(request_id, None)
        if key is not None:
            self._drop_user_locked(key)

    def _drop_user_locked(self, key: str) -> None:
        self._users[key] -= 1
        if self._users[key] <= 0:
            del self._users[key]


def close_channels(channels: list[WorkerChannel]) -> None:
    """Close what a ``ChannelTable`` call handed back (outside its lock)."""
    for channel in channels:
        channel.close()
