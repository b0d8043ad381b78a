"""Carries each worker's output stream for this gateway into the placements' trackers: one
thread per worker, reading the batches its engine steps produce until the worker or the
cluster stops. Each batch is handed on with the time it arrived (for first tokens' traces)."""

from __future__ import annotations

import logging
import threading
import time

import ray

from router.placements import Placements
from router.worker_pool import WorkerHandle, WorkerPool

logger = logging.getLogger("router.cluster")


class OutputPump:
    def __init__(self, gateway_id: str, pool: WorkerPool, placements: Placements) -> None:
        self.gateway_id = gateway_id
        self._pool = pool
        self._placements = placements
        self._started: set[str] = set()  # workers whose stream is read (one thread each)
        self._lock = threading.Lock()  # guards _started

    def start(self, worker: WorkerHandle) -> None:
        """Read ``worker``'s output stream on a thread of its own (once per worker)."""
        with self._lock:
            if worker.worker_id in self._started:
                return
            self._started.add(worker.worker_id)
        self._pool.spawn(self._pump, worker, name=f"pump-{worker.worker_id}")

    def _pump(self, worker: WorkerHandle) -> None:
        stream = worker.actor.stream.options(num_returns="streaming").remote(self.gateway_id)
        try:
            for ref in stream:
                if self._pool.stopping.is_set():
                    return
                batch = ray.get(ref)
                try:
                    self._placements.dispatch(batch, time.time())
                except Exception:  # a bug: the other requests' tokens keep flowing
                    logger.exception("dispatching a batch of %s failed", worker.worker_id)
        except Exception:  # the worker died: the load poll takes it out of rotation
            logger.info("output stream of %s ended", worker.worker_id)
