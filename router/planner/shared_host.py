"""One host's cores, shared by the workers' engine threads and the host's other work (the
gateway, the router, a load generator on the same machine): the planner's model of a CPU
machine, where workers have no device of their own (``pdserve plan``'s simulation).

A fluid processor-sharing model. A busy worker runs a step of ``work_s`` seconds (its time
alone, as the profile measured it) on ``threads`` cores; after it, its process's work on the
step's outputs (``worker_seconds_per_token`` a sampled token) runs on one core as such work
too, and so do a prefill worker's KV hand-offs (their copies and calls,
``seconds_per_handoff`` each), after the outputs of the step that finished their prompts. The
host's other work is the streaming of tokens: each sampled token costs CPU seconds of it, done
first come first served by ``front_door_threads`` threads, and reaches its client when its
share is done. While the runnable threads outnumber the cores, each runs at
``cores / runnable`` of its speed (the kernel's fair share); otherwise at full speed. So a step
ends later than alone by the share it lost, and on a saturated host tokens queue behind the
streaming of those before them. A step's outputs leave as one batch: besides its tokens' costs,
the batch costs its worker's process ``worker_seconds_per_batch`` and the host's other work
``seconds_per_batch`` (measured: a busy host's cost per token falls as batches grow).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

_EPSILON_S = 1e-12


@dataclass(frozen=True, slots=True)
class HostShare:
    """The host the workers share: its cores, and its other work per streamed token."""

    cores: int
    seconds_per_token: float = 0.0  # CPU seconds of the host's other work a streamed token costs
    # and a KV hand-off (its copies and calls), in the prefill worker's process
    seconds_per_handoff: float = 0.0
    front_door_threads: int = 1  # the threads the streaming runs on, at most
    # and a sampled token in its worker's own process (its output made and streamed out)
    worker_seconds_per_token: float = 0.0
    # a step's batch of outputs, whatever its tokens: in the worker's process (made and sent)
    # and in the host's other work (received and routed to the tokens' streams)
    worker_seconds_per_batch: float = 0.0
    seconds_per_batch: float = 0.0

    def __post_init__(self) -> None:
        seconds = (
            self.seconds_per_token,
            self.seconds_per_handoff,
            self.worker_seconds_per_token,
            self.worker_seconds_per_batch,
            self.seconds_per_batch,
        )
        if self.cores < 1 or min(seconds) < 0 or self.front_door_threads < 1:
            raise ValueError(
                f"a shared host needs cores >= 1, seconds_per_token, seconds_per_handoff, "
                f"worker_seconds_per_token, worker_seconds_per_batch and seconds_per_batch >= 0 "
                f"and front_door_threads >= 1, not {self.cores}, {seconds} and "
                f"{self.front_door_threads}"
            )


@dataclass(slots=True)
class _Step:
    remaining_s: float  # of its time alone
    threads: int
    done: Callable[[], None]


class SharedHost:
    """The steps running on the host and its backlog of other work, on the simulation's
    clock: ``at(time, action)`` schedules an action, ``clock()`` reads the time."""

    def __init__(
        self,
        share: HostShare,
        clock: Callable[[], float],
        at: Callable[[float, Callable[[], None]], None],
    ) -> None:
        self.share = share
        self._clock = clock
        self._at = at
        self._steps: dict[Hashable, _Step] = {}
        # the other work: CPU seconds added and done so far, and when each delivery is due
        self._added_s = 0.0
        self._done_s = 0.0
        self._deliveries: deque[tuple[float, Callable[[], None]]] = deque()
        self._updated = 0.0
        self._epoch = 0  # scheduled ends of an earlier epoch are stale
        self.busy_thread_seconds = 0.0  # what ran, all threads together (a check on the model)

    def start(self, key: Hashable, work_s: float, threads: int, done: Callable[[], None]) -> None:
        """A step of ``work_s`` seconds alone on ``threads`` cores; ``done()`` at its end."""
        if key in self._steps:
            raise ValueError(f"{key!r} already runs a step")
        self._advance()
        self._steps[key] = _Step(max(0.0, work_s), max(1, threads), done)
        self._reschedule()

    def stream(self, work: Sequence[tuple[float, Callable[[], None]]]) -> None:
        """CPU seconds of the host's other work, in order (each token's streaming), after the
        work before it; each ``delivered()`` once its work is done: at once when none costs
        anything and none waits before it."""
        if not self._deliveries and all(seconds <= 0 for seconds, _ in work):
            for _, delivered in work:
                delivered()
            return
        self._advance()
        for seconds, delivered in work:
            self._added_s += max(0.0, seconds)
            self._deliveries.append((self._added_s, delivered))
        self._reschedule()

    @property
    def backlog_s(self) -> float:
        return max(0.0, self._added_s - self._done_s)

    def speed(self) -> float:
        """Each runnable thread's share of a core now."""
        runnable = sum(step.threads for step in self._steps.values())
        if self.backlog_s > _EPSILON_S:
            runnable += self.share.front_door_threads
        return min(1.0, self.share.cores / runnable) if runnable else 1.0

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._updated
        self._updated = now
        if elapsed <= 0:
            return
        speed = self.speed()
        for step in self._steps.values():
            step.remaining_s = max(0.0, step.remaining_s - elapsed * speed)
            self.busy_thread_seconds += elapsed * speed * step.threads
        ran = min(self.backlog_s, elapsed * speed * self.share.front_door_threads)
        self._done_s += ran
        self.busy_thread_seconds += ran

    def _reschedule(self) -> None:
        """Schedule each step's end, and the next delivery, at the speed from now on (those
        scheduled before are now stale)."""
        self._epoch += 1
        epoch, speed, now = self._epoch, self.speed(), self._updated
        for key, step in self._steps.items():
            self._at(now + step.remaining_s / speed, functools.partial(self._step_ends, key, epoch))
        if self._deliveries:
            due_s = max(0.0, self._deliveries[0][0] - self._done_s)
            rate = speed * self.share.front_door_threads
            self._at(now + due_s / rate, functools.partial(self._delivery_due, epoch))

    def _step_ends(self, key: Hashable, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        step = self._steps.pop(key)
        self._reschedule()
        step.done()

    def _delivery_due(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        self._done_s = max(self._done_s, self._deliveries[0][0])  # (due: nothing changed since)
        delivered = []
        while self._deliveries and self._deliveries[0][0] <= self._done_s + _EPSILON_S:
            delivered.append(self._deliveries.popleft()[1])
        if not self._deliveries:
            self._done_s = self._added_s
        self._reschedule()
        for deliver in delivered:
            deliver()
