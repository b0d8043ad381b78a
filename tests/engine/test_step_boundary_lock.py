"""The engine lock lets a waiting caller in at the next step boundary, not after many steps."""

from __future__ import annotations

import threading
import time

from engine.step_boundary_lock import StepBoundaryLock

_TURN_S = 0.002  # one "engine step" with the lock held


class _BusyLoop:
    """An engine loop stand-in: takes the lock for back-to-back turns, counting them."""

    def __init__(self, lock: StepBoundaryLock) -> None:
        self.lock = lock
        self.num_turns = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock.loop_turn():
                time.sleep(_TURN_S)  # releases the GIL while holding the lock, as a step does
                self.num_turns += 1

    def __enter__(self) -> _BusyLoop:
        self.thread.start()
        deadline = time.monotonic() + 60
        while self.num_turns < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def _turns_waited(lock: StepBoundaryLock, loop: _BusyLoop) -> int:
    before = loop.num_turns
    with lock:
        return loop.num_turns - before


def test_a_caller_waits_at_most_the_turn_in_progress() -> None:
    lock = StepBoundaryLock()
    with _BusyLoop(lock) as loop:
        waits = [_turns_waited(lock, loop) for _ in range(200)]
    assert max(waits) <= 1, waits


def test_reentrant_for_a_caller_and_inside_a_turn() -> None:
    lock = StepBoundaryLock()
    with lock, lock:
        pass
    with lock.loop_turn(), lock:
        pass


def test_many_callers_all_get_in_and_the_loop_goes_on() -> None:
    lock = StepBoundaryLock()
    entered: list[int] = []
    with _BusyLoop(lock) as loop:

        def caller(index: int) -> None:
            with lock:
                entered.append(index)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        turns_after_callers = loop.num_turns
        deadline = time.monotonic() + 60
        while loop.num_turns < turns_after_callers + 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert loop.num_turns >= turns_after_callers + 3  # the loop was not left waiting
    assert sorted(entered) == list(range(16))
