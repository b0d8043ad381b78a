"""A prefill worker's hand-offs, one lane of threads per decode worker.

A hand-off waits on its decode worker: for blocks when that worker is full, for a channel to
open, for the transfer, for the receipt. With one shared pool, a full, slow or hung decode
worker took every thread and the hand-offs to healthy ones queued behind it. Each decode worker
gets its own lane instead, created on first use; its threads start only when needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class HandoffLanes:
    def __init__(self, threads_per_lane: int, name: str) -> None:
        if threads_per_lane < 1:
            raise ValueError(f"threads_per_lane must be >= 1, got {threads_per_lane}")
        self.threads_per_lane = threads_per_lane
        self.name = name
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, decode_worker_id: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the lane of ``decode_worker_id``."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: hand-off lanes are shut down")
            lane = self._lanes.get(decode_worker_id)
            if lane is None:
                lane = ThreadPoolExecutor(
                    self.threads_per_lane, thread_name_prefix=f"{self.name}-{decode_worker_id}"
                )
                self._lanes[decode_worker_id] = lane
            return lane.submit(fn, *args)

    def shutdown(self) -> None:
        """Drop the hand-offs not started; wait for the running ones."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        for lane in lanes:
            lane.shutdown(wait=True)
