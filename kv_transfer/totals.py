"""Running totals of one worker's KV transfers, and the latest ones' timings, for its load
reports (torch-free)."""

from __future__ import annotations

import threading
from collections import deque

from kv_transfer.messages import TransferStats

# transfers whose timings are kept between two load reports (the latest ones)
TRANSFER_TIMINGS_KEPT = 256


class TransferTotals:
    """Thread-safe sums over the transfers a worker ran (hand-off threads add to it)."""

    def __init__(self, *, keep_timings: bool = False) -> None:
        """``keep_timings``: keep each transfer's timing until ``take_timings`` (else only the
        sums)."""
        self._lock = threading.Lock()
        self.num_transfers = 0
        self.num_bytes = 0
        self.seconds = 0.0
        # (blocks, bytes, seconds, transport, peer, seconds waited before it) of each transfer
        # since the last ``take_timings``
        self._recent: deque[tuple[int, int, float, str, str, float]] = deque(
            maxlen=TRANSFER_TIMINGS_KEPT if keep_timings else 0
        )

    def add(
        self,
        stats: TransferStats,
        transport: str,
        num_blocks: int,
        peer: str = "",
        waited_s: float = 0.0,
    ) -> None:
        """Count a transfer of ``num_blocks`` blocks over ``transport`` to ``peer``, which
        waited ``waited_s`` for the peer's room first."""
        with self._lock:
            self.num_transfers += 1
            self.num_bytes += stats.nbytes
            self.seconds += stats.total_s
            self._recent.append(
                (num_blocks, stats.nbytes, stats.total_s, transport, peer, waited_s)
            )

    def waited(self, peer: str, waited_s: float) -> None:
        """A transfer to ``peer`` given up after waiting ``waited_s`` for its room: nothing
        moved (no transport), but its timings keep the wait."""
        with self._lock:
            self._recent.append((0, 0, 0.0, "", peer, waited_s))

    def snapshot(self) -> tuple[int, int, float]:
        """(transfers, bytes, seconds) so far."""
        with self._lock:
            return self.num_transfers, self.num_bytes, self.seconds

    def take_timings(self) -> list[tuple[int, int, float, str, str, float]]:
        """(blocks, bytes, seconds, transport, peer, seconds waited) of each transfer since the
        last take, oldest first."""
        with self._lock:
            taken = list(self._recent)
            self._recent.clear()
            return taken
