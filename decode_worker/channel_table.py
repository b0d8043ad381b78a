"""A decode worker's open KV channels from prefill workers: which are in use, which are pinned
open for a reservation, and which close when a new one pushes the count over the cap.

A channel is in use while a receive runs on it, and pinned from a prefill worker's reserve (or
its joining, or ``pin``) until that request's receive ends or its reservation is cancelled: its
KV is on the way, so closing it would leave the sender writing to a closed end. Only channels
neither in use nor pinned close over the cap, least recently used first: when one opens, and
when one stops being used (so the count comes back under the cap at rest). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

from kv_transfer import KVChannel


class ChannelTable:
    def __init__(self, max_channels: int) -> None:
        self.max_channels = max_channels
        # channel id -> channel, least recently used first
        self._channels: OrderedDict[str, KVChannel] = OrderedDict()
        self._users: Counter[str] = Counter()  # channel id -> receives on it, and pins
        self._pins: dict[str, str] = {}  # request id -> channel pinned open for its KV
        self._lock = threading.Lock()

    def add(
        self, channel_id: str, channel: KVChannel, pin_for: str | None = None
    ) -> list[KVChannel]:
        """Open ``channel`` (pinned for request ``pin_for``, if given); the channels the caller
        must close (one it replaces, idle ones over the cap)."""
        with self._lock:
            previous = self._channels.pop(channel_id, None)
            self._channels[channel_id] = channel
            if pin_for is not None:
                self._pin_locked(pin_for, channel_id)
            closing = self._over_cap_locked(keep=channel_id)
        return [*([previous] if previous is not None else []), *closing]

    def pin(self, request_id: str, channel_id: str) -> bool:
        """Keep ``channel_id`` open for ``request_id``'s KV; False if it is not open."""
        with self._lock:
            if channel_id not in self._channels:
                return False
            self._pin_locked(request_id, channel_id)
            return True

    def unpin(self, request_id: str) -> list[KVChannel]:
        """End a request's pin; the channels the caller must close (now idle over the cap)."""
        with self._lock:
            self._unpin_locked(request_id)
            return self._over_cap_locked()

    def take(self, request_id: str, channel_id: str) -> KVChannel | None:
        """The channel for ``request_id``'s receive, in use until ``release``; None when it is
        not open. The request's pin passes to the receive."""
        with self._lock:
            channel = self._channels.get(channel_id)
            if channel is not None and self._pins.get(request_id) == channel_id:
                del self._pins[request_id]  # its count now stands for the receive
            else:
                self._unpin_locked(request_id)
                if channel is not None:
                    self._users[channel_id] += 1
            if channel is not None:
                self._channels.move_to_end(channel_id)
            return channel

    def release(self, channel_id: str) -> list[KVChannel]:
        """A receive on ``channel_id`` (from ``take``) has ended; the channels the caller must
        close (now idle over the cap)."""
        with self._lock:
            self._drop_user_locked(channel_id)
            return self._over_cap_locked()

    def remove(self, channel_id: str, channel: KVChannel) -> None:
        """Forget a broken channel (if still the one open under its id); the caller closes it."""
        with self._lock:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]

    def remove_all(self) -> list[KVChannel]:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        return channels

    def __contains__(self, channel_id: object) -> bool:
        with self._lock:
            return channel_id in self._channels

    @property
    def num_pins(self) -> int:
        with self._lock:
            return len(self._pins)

    def _pin_locked(self, request_id: str, channel_id: str) -> None:
        self._unpin_locked(request_id)
        self._pins[request_id] = channel_id
        self._users[channel_id] += 1
        self._channels.move_to_end(channel_id)

    def _over_cap_locked(self, keep: str | None = None) -> list[KVChannel]:
        """Take idle channels out (but ``keep``) while over the cap, least recently used first."""
        excess = len(self._channels) - self.max_channels
        if excess <= 0:
            return []
        idle = [cid for cid in self._channels if cid != keep and not self._users[cid]]
        return [self._channels.pop(cid) for cid in idle[:excess]]

    def _unpin_locked(self, request_id: str) -> None:
        channel_id = self._pins.pop(request_id, None)
        if channel_id is not None:
            self._drop_user_locked(channel_id)

    def _drop_user_locked(self, channel_id: str) -> None:
        self._users[channel_id] -= 1
        if self._users[channel_id] <= 0:
            del self._users[channel_id]
