"""Each pool's busy share over the rebalancer's window: from the workers' cumulative step
seconds (their busy time, as their step timings report it), sampled each tick.

Reports arrive in bursts, so one tick's difference swings between 0 and 1 for the same load;
the share over the whole window (``window_s``) is what the rebalancing rule reads. A worker
seen for less than the window counts from its first sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping


class BusyShare:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # (time, busy seconds by worker) of each tick, the oldest one at or before the
        # window's start first
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def update(self, now: float, busy_seconds: Mapping[str, float]) -> None:
        """A tick's sample: each worker's busy seconds so far."""
        self._samples.append((now, dict(busy_seconds)))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def share(self, worker_ids: Iterable[str]) -> float | None:
        """The workers' busy seconds over their seconds, since the window's start (or their
        first sample); 0.0 for none; None before two samples."""
        if len(self._samples) < 2:
            return None
        now, latest = self._samples[-1]
        busy = seconds = 0.0
        for worker in worker_ids:
            for at, sample in self._samples:  # the oldest sample that has the worker
                if worker in sample:
                    busy += latest.get(worker, sample[worker]) - sample[worker]
                    seconds += now - at
                    break
        return busy / seconds if seconds > 0 else 0.0
