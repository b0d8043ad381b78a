"""The timings of an engine's latest steps, kept for the worker's next load report.

Each step that ran the model is recorded with what it computed (prompt tokens and the context
they attend to, decode rows and the KV they read) and its wall time; the router's latency model
(router/latency_model.py) is fitted from them. The engine thread records, the thread answering
the load report takes: both through one bounded deque, safe without a lock.

In a worker, a step's time is its engine loop's turn (engine/engine_loop.py): the step, and the
work of turning its tokens into events for the gateways, which steps back to back pay too. The
loop holds each step's timing back (``hold_for_turns``) and gives it the turn's time when the
turn ends (``end_turn``); a step run outside a turn (the start-up profile, under ``call``) keeps
its own time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from engine.kv_cache.cache_groups import CacheGroups
from engine.messages import StepTiming
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput

# steps kept between two reports: the latest ones are kept when reports are far apart
STEP_TIMINGS_KEPT = 256
_WHOLE_CONTEXT = CacheGroups.single(1)  # every layer sees the whole context


class StepTimingLog:
    def __init__(self, capacity: int = STEP_TIMINGS_KEPT) -> None:
        self._timings: deque[StepTiming] = deque(maxlen=capacity)
        self.hold_for_turns = False  # a loop ends each step's turn (``end_turn``)
        self._held: StepTiming | None = None  # the step of the turn under way

    def record(self, timing: StepTiming) -> None:
        """A step ran (on the engine's thread, or under its lock)."""
        if self._held is not None:  # a step outside any turn: it keeps its own time
            self._timings.append(self._held)
        if self.hold_for_turns:
            self._held = timing
        else:
            self._held = None
            self._timings.append(timing)

    def end_turn(self, seconds: float) -> None:
        """The loop's turn around the step recorded last took ``seconds`` in all."""
        held, self._held = self._held, None
        if held is not None:
            self._timings.append(replace(held, seconds=max(held.seconds, seconds)))

    def take(self) -> tuple[StepTiming, ...]:
        """The timings recorded since the last take, oldest first."""
        taken = []
        while self._timings:  # (only this thread takes: the deque cannot empty meanwhile)
            taken.append(self._timings.popleft())
        return tuple(taken)


@dataclass(frozen=True, slots=True)
class StepClock:
    """When a step began: the wall clock, and the CPU time of the thread running it."""

    wall_s: float
    thread_cpu_s: float

    @classmethod
    def start(cls) -> StepClock:
        return cls(time.perf_counter(), time.thread_time())

    def elapsed(self) -> tuple[float, float]:
        """(wall seconds, this thread's CPU seconds) since the start: on a shared host the
        CPU time falls short of the wall time by what other threads took from it."""
        return time.perf_counter() - self.wall_s, time.thread_time() - self.thread_cpu_s


def step_timing(output: SchedulerOutput, seconds: float) -> StepTiming:
    """What ``output``'s step computed, taken before its tokens are applied, and ``seconds``.

    A prompt chunk (an entry of several new tokens, or one at a prompt position) attends, for
    its ``n`` new tokens from position ``s``, to ``n * s + n * (n + 1) / 2`` (query, key) pairs;
    a decode row reads the KV of every position up to its own.
    """
    prefill_tokens = attention = decode_tokens = context = 0
    for entry in output.scheduled:
        start, new = entry.start_position, entry.num_new_tokens
        if _is_prompt_chunk(entry):
            prefill_tokens += new
            attention += new * start + new * (new + 1) // 2
        else:
            decode_tokens += entry.num_query_tokens
            context += entry.num_query_tokens * (start + 1)
    return StepTiming(prefill_tokens, attention, decode_tokens, context, seconds)


def roofline_counts(
    output: SchedulerOutput, cache_groups: CacheGroups | None = None
) -> tuple[float, float]:
    """For ``pdserve plan``'s roofline, in one pass: the KV tokens ``output``'s decoding
    sequences read, each sequence's once (a sequence with drafts runs its token and drafts like
    a prompt chunk, whose attention kernel reads the KV once for all of them on a GPU), and the
    (query, key) pairs its step attends, every row to the positions up to its own; both
    averaged over the layers, a sliding layer's within its window (``cache_groups``). The step
    above counts a row's context per row, as the workers report it (the CPU's time grows so)."""
    groups = cache_groups or _WHOLE_CONTEXT
    kv_tokens = pairs = 0.0
    for entry in output.scheduled:
        start, rows = entry.start_position, entry.num_query_tokens
        pairs += groups.mean_pairs(start, rows)
        if not _is_prompt_chunk(entry):
            kv_tokens += groups.mean_positions_read(start + rows)
    return kv_tokens, pairs


def _is_prompt_chunk(entry: ScheduledSequence) -> bool:
    """An entry of several new tokens, or one at a prompt position (else: a decode row, with
    its drafts if any)."""
    return entry.num_new_tokens > 1 or entry.start_position < entry.seq.num_prompt_tokens
