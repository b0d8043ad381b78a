"""The engine's lock, handed to waiting callers at every step boundary.

A worker's engine steps on its own thread with the lock held; other threads (a request being
submitted, an abort, a KV hand-off, a load report) take the same lock between steps. Python's
locks are not fair: the engine thread releases the lock after a step and takes it again at
once, almost always before a thread already waiting for it has woken, so a caller could wait
for many steps.

Here the loop takes the lock for a step only once no caller is waiting for it, so a caller
waits at most for the step in progress. Callers use ``with lock:`` as with any lock (re-entrant,
like ``threading.RLock``); the loop uses ``with lock.loop_turn():``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class StepBoundaryLock:
    def __init__(self) -> None:
        self.inner = threading.RLock()  # the lock itself (a Condition may be built on it)
        self._waiters = threading.Condition(threading.Lock())
        self._num_waiting = 0  # callers blocked in __enter__, under _waiters

    # ---- callers ------------------------------------------------------------------------
    def __enter__(self) -> StepBoundaryLock:
        with self._waiters:
            self._num_waiting += 1
        try:
            self.inner.acquire()
        finally:
            with self._waiters:
                self._num_waiting -= 1
                if not self._num_waiting:
                    self._waiters.notify_all()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.inner.release()

    # ---- the engine loop ----------------------------------------------------------------
    @contextmanager
    def loop_turn(self) -> Iterator[None]:
        """Hold the lock for one turn of the loop, after every caller waiting now got it."""
        with self._waiters:
            while self._num_waiting:
                self._waiters.wait()
        with self.inner:
            yield
