"""Running totals of one worker's KV transfers, for its load reports (torch-free)."""

from __future__ import annotations

import threading

from kv_transfer.messages import TransferStats


class TransferTotals:
    """Thread-safe sums over the transfers a worker ran (hand-off threads add to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_transfers = 0
        self.num_bytes = 0
        self.seconds = 0.0

    def add(self, stats: TransferStats) -> None:
        with self._lock:
            self.num_transfers += 1
            self.num_bytes += stats.nbytes
            self.seconds += stats.total_s

    def snapshot(self) -> tuple[int, int, float]:
        """(transfers, bytes, seconds) so far."""
        with self._lock:
            return self.num_transfers, self.num_bytes, self.seconds
