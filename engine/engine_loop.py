"""Runs one LLMEngine on a background thread for a worker; other threads talk to it safely.

Lifecycle: start() -> any thread submits, aborts or calls into the engine under ``lock``; the
loop steps while there is work and publishes each step's tokens as one ``OutputBatch`` per
gateway (never one message per token); prefill-only requests that reach their hand-off go to
``on_handed_off`` after the step's tokens are published (a first token never waits for its
hand-off) -> stop(). A method whose name ends in ``_locked`` expects its caller to hold ``lock``.

A request submitted here has its first token traced (``FirstTokenTrace``, wall clock): when
the worker got it (``submit``'s ``received_at``), when it entered the engine, when it was first
scheduled, the start and end of the step that sampled the token, and when that step's batch was
put on the output queue; the stream stamps each batch as it takes it off the queue
(``OutputBatch.streamed_at``).

Where the engine records KV events (a worker's), each turn's events become one batch of the
loop's ``KVEventLog``: the load report answers the router's cursor from it, and each output
batch carries the event batches since that gateway's previous one (engine/kv_cache/kv_events.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from engine.kv_cache.kv_events import KVEventLog
from engine.llm_engine import LLMEngine, StepResult
from engine.messages import (
    FirstTokenTrace,
    GenerateRequest,
    KVCursor,
    KVEventsReply,
    OutputBatch,
    PrefillResult,
    RequestFailure,
    TokenEvent,
    TransferTiming,
    WorkerLoad,
)
from engine.sampling import SamplingParams
from engine.step_boundary_lock import StepBoundaryLock

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        worker_id: str,
        on_handed_off: Callable[[PrefillResult], None] | None = None,
        on_ranks_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_ranks_lost``: called, from the loop's thread, when a step of a worker of several
        ranks fails in a collective (a follower rank died or hung); by default this process
        exits, so that the router takes the worker out of rotation and recovers its requests
        elsewhere, as for any worker whose process is gone."""
        self.engine = engine
        engine.step_timings.hold_for_turns = True  # each step's time: its turn's (``_run``)
        self.worker_id = worker_id
        self._on_ranks_lost = on_ranks_lost or _exit_process
        self.lock = StepBoundaryLock()  # held while the engine steps or is called into
        self._work = threading.Condition(self.lock.inner)  # new work for the loop (under lock)
        self._on_handed_off = on_handed_off
        self._gateway_of: dict[str, str] = {}  # request id -> gateway id
        # request id -> (received, queued): wall-clock times of a request submitted here whose
        # first token has not left yet (under lock)
        self._arrivals: dict[str, tuple[float, float]] = {}
        self._outputs: defaultdict[str, queue.Queue[OutputBatch]] = defaultdict(queue.Queue)
        self._outputs_lock = threading.Lock()
        self._stopping = False
        # the blocks the engine's prefix cache stored and removed, batched per turn, for the
        # router's index (None: the engine does not record them)
        self._kv_event_log = KVEventLog() if engine.records_kv_events else None
        # gateway id -> the last event batch its output batches carried: set when a request of
        # a new gateway comes in (under ``lock``), then moved on by the loop's thread only
        self._kv_streamed: dict[str, int] = {}
        # The load as of the last change made under ``lock``: ``load`` answers with it without
        # waiting for the lock, so a long step never holds back a report (replaced, never
        # changed in place: readers take the reference without a lock).
        self._load_report = self._measure_load_locked()
        self._turn_ended_at = time.monotonic()  # the loop's last step or wait for work ended
        self._thread = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self._work.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # ---- calls from other threads -------------------------------------------------------
    def submit(
        self,
        request: GenerateRequest,
        *,
        prefill_only: bool = False,
        received_at: float | None = None,
    ) -> bool:
        """Queue a request; False if it is here already (a repeated resume is a no-op).

        ``received_at``: when the worker's call began (``time.time()``; default: now), the
        start of its first token's time in this worker. Raises ValueError (nothing queued) when
        the request is invalid.
        """
        received_at = time.time() if received_at is None else received_at
        self.prepare(request.params)
        with self._changing():
            if self.engine.has_request(request.request_id):
                return False
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                cache_salt=request.cache_salt,
                prefill_only=prefill_only,
                priority=request.priority,
                resume_token_ids=request.resume_token_ids or None,
            )
            self._gateway_of[request.request_id] = request.gateway_id
            self._stream_kv_events_to_locked(request.gateway_id)
            # when the engine took it: its queue time (TokenEvent.queue_seconds) counts from here
            self._arrivals[request.request_id] = (received_at, time.time())
            self._work.notify()
            return True

    def prepare(self, params: SamplingParams) -> None:
        """Compile what ``params`` needs before the lock is taken (a structured-output grammar:
        up to ~100 ms for a large schema), so that the running requests keep stepping
        meanwhile. An error is left for the call that adds the request to raise."""
        if params.structured_outputs is not None:
            with contextlib.suppress(ValueError):
                self.engine.grammars(params.structured_outputs)  # cached for the add

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` under the lock, then let the loop look for new work."""
        with self._changing():
            result = fn(self.engine)
            self._work.notify()
            return result

    def track(self, request_id: str, gateway_id: str) -> None:
        """Route a request's outputs (e.g. one admitted from a prefill worker) to a gateway."""
        with self.lock:
            self._gateway_of[request_id] = gateway_id
            self._stream_kv_events_to_locked(gateway_id)

    def release(self, request_id: str) -> None:
        """End a handed-off request here: its lease is released, its outputs go elsewhere."""
        with self._changing():
            self.engine.release_lease(request_id)
            self._forget_locked(request_id)

    def abort(self, request_id: str) -> None:
        with self._changing():
            self.engine.abort_request(request_id)
            self._forget_locked(request_id)

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock to change the engine; the load report is taken again on the way out."""
        with self.lock:
            try:
                yield
            finally:
                self._log_kv_events_locked()
                self._load_report = self._measure_load_locked()

    def fail(
        self,
        request_id: str,
        message: str,
        gateway_id: str | None = None,
        *,
        retryable: bool = False,
    ) -> None:
        """Drop a request and tell its gateway why (and whether another worker may retry it)."""
        with self._changing():
            self.engine.abort_request(request_id)
            self._arrivals.pop(request_id, None)
            gateway = self._gateway_of.pop(request_id, gateway_id)
        if gateway is not None:
            failure = RequestFailure(request_id, message, retryable)
            self._queue(gateway).put(OutputBatch(self.worker_id, [], [failure]))

    def stream(self, gateway_id: str, poll_s: float = 0.2) -> Iterator[OutputBatch]:
        """A gateway's output batches as the steps produce them, until the loop stops; each
        stamped with the time it was taken off the queue (``streamed_at``)."""
        while not self._stopping:
            batch = self.next_batch(gateway_id, poll_s)
            if batch is not None:
                yield dataclasses.replace(batch, streamed_at=time.time())

    def next_batch(self, gateway_id: str, timeout_s: float) -> OutputBatch | None:
        """The next output batch for a gateway, or None after ``timeout_s`` without one."""
        try:
            return self._queue(gateway_id).get(timeout=timeout_s)
        except queue.Empty:
            return None

    def load(
        self,
        kv_transfers: tuple[int, int, float] = (0, 0, 0.0),
        kv_cursor: KVCursor | None = None,
        transfer_timings: tuple[TransferTiming, ...] = (),
    ) -> WorkerLoad:
        """This worker's load report for the router, as of the last change made under the lock
        (never waiting for the step in progress); ``kv_transfers`` are the worker's KV hand-off
        totals (transfers, bytes, seconds), which the engine does not see (nor its process's
        CPU time, all threads, read now), and
        ``transfer_timings`` those it ran since its last report. With ``kv_cursor`` it carries
        the KV events after that cursor (where the engine records them). It carries the timings
        of the steps since the last report (taken: each goes in one report)."""
        report = self._load_report
        num_transfers, num_bytes, seconds = kv_transfers
        counters = dataclasses.replace(
            report.counters,
            num_kv_transfers=num_transfers,
            num_kv_transfer_bytes=num_bytes,
            kv_transfer_seconds=seconds,
            process_cpu_seconds=time.process_time(),
        )
        since_progress_s = max(0.0, time.monotonic() - self._turn_ended_at)
        kv_events = None
        if kv_cursor is not None and self._kv_event_log is not None:
            kv_events = self._kv_event_log.since(kv_cursor)
        return dataclasses.replace(
            report,
            counters=counters,
            seconds_since_progress=since_progress_s,
            kv_events=kv_events,
            step_timings=self.engine.step_timings.take(),
            transfer_timings=transfer_timings,
        )

    def _log_kv_events_locked(self) -> None:
        if self._kv_event_log is not None:
            self._kv_event_log.append(self.engine.take_kv_events())

    def _measure_load_locked(self) -> WorkerLoad:
        """The engine's load now, without the worker's KV transfer totals."""
        scheduler = self.engine.scheduler
        return WorkerLoad(
            worker_id=self.worker_id,
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_queued_prompt_tokens=scheduler.num_queued_prompt_tokens,
            kv_usage=self.engine.block_manager.usage,
            counters=self.engine.counters(),
            num_context_tokens=sum(s.num_computed_tokens for s in scheduler.running),
        )

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock.loop_turn():
                while not self._stopping and not self.engine.scheduler.num_unfinished:
                    self._work.wait(_IDLE_WAIT_S)
                    self._end_turn_locked()  # (callers may change the engine without ``call``)
                if self._stopping:
                    return
                step_started_at, turn_started = time.time(), time.perf_counter()
                try:
                    step = self.engine.step()
                    step_ended_at = time.time()
                except Exception as error:
                    if self._lost_a_rank(error):  # the worker cannot step again
                        logger.critical("a rank of %s is lost: %s", self.worker_id, error)
                        self._on_ranks_lost(error)  # (by default, never returns)
                        self._fail_all_locked("a rank of this worker is lost")
                        self._stopping = True
                        return
                    # a bug: fail what is in flight, keep the worker up
                    logger.exception("engine step failed on %s", self.worker_id)
                    self._fail_all_locked("internal error in the engine step")
                    continue
                finally:
                    self._end_turn_locked()
                outputs = self._outputs_locked(step)
                # the step's time, for the latency model: its whole turn, outputs included
                self.engine.step_timings.end_turn(time.perf_counter() - turn_started)
            self._publish(outputs, step_started_at, step_ended_at)
            if self._on_handed_off is not None:
                for result in step.handed_off:
                    self._on_handed_off(result)

    def _lost_a_rank(self, error: Exception) -> bool:
        """Whether a step failed in a collective of the worker's ranks (a peer gone, or past
        the group's deadline) rather than in this rank's own code."""
        return self.engine.group is not None and isinstance(error, (ConnectionError, TimeoutError))

    def _end_turn_locked(self) -> None:
        """A turn of the loop (a step, or a wait for work) ended: log its KV events, take the
        load again."""
        self._log_kv_events_locked()
        self._load_report = self._measure_load_locked()
        self._turn_ended_at = time.monotonic()

    def _outputs_locked(self, step: StepResult) -> _StepOutputs:
        """A step's token events by gateway, with the arrivals of the first tokens among them
        (taken out of ``_arrivals``); the requests it finished are forgotten."""
        outputs = _StepOutputs(defaultdict(list), [])
        for event in step.new_tokens:
            gateway = self._gateway_of.get(event.request_id)
            if gateway is None:
                continue
            events = outputs.events[gateway]
            if event.position == 0 and event.sample_index == 0:
                arrival = self._arrivals.pop(event.request_id, None)
                if arrival is not None:
                    outputs.first_tokens.append((gateway, len(events), arrival))
            events.append(event)
        for output in step.finished:
            self._forget_locked(output.request_id)
        return outputs

    def _publish(self, outputs: _StepOutputs, step_started_at: float, step_ended_at: float) -> None:
        """Put a step's batches on their gateways' queues, its first tokens traced."""
        emitted_at = time.time()
        for gateway, index, (received_at, queued_at) in outputs.first_tokens:
            events = outputs.events[gateway]
            event = events[index]
            trace = FirstTokenTrace(
                worker_id=self.worker_id,
                received_at=received_at,
                queued_at=queued_at,
                scheduled_at=queued_at + event.queue_seconds,
                step_started_at=step_started_at,
                step_ended_at=step_ended_at,
                emitted_at=emitted_at,
            )
            events[index] = dataclasses.replace(event, first_token_trace=trace)
        for gateway, events in outputs.events.items():
            batch = OutputBatch(self.worker_id, events, kv_events=self._kv_events_for(gateway))
            self._queue(gateway).put(batch)

    def _stream_kv_events_to_locked(self, gateway_id: str) -> None:
        """A gateway's output batches carry the KV events from the log's current batch on
        (earlier ones: the router's load poll brings them in a snapshot)."""
        if self._kv_event_log is not None and gateway_id not in self._kv_streamed:
            self._kv_streamed[gateway_id] = self._kv_event_log.number

    def _kv_events_for(self, gateway_id: str) -> KVEventsReply | None:
        """The KV event batches to send a gateway with a step's tokens: those since the ones
        it was last sent."""
        log = self._kv_event_log
        if log is None:
            return None
        last = self._kv_streamed.get(gateway_id)
        if last is None:
            self._kv_streamed[gateway_id] = log.number
            return None
        reply = log.after(last)
        self._kv_streamed[gateway_id] = reply.number
        return reply if reply.batches else None

    def _forget_locked(self, request_id: str) -> None:
        """The request's outputs go nowhere from here (it ended, or went elsewhere)."""
        self._gateway_of.pop(request_id, None)
        self._arrivals.pop(request_id, None)

    def _fail_all_locked(self, message: str) -> None:
        self._arrivals.clear()
        for request_id in list(self._gateway_of):
            gateway = self._gateway_of.pop(request_id)
            self.engine.abort_request(request_id)
            failure = RequestFailure(request_id, message)
            self._queue(gateway).put(OutputBatch(self.worker_id, [], [failure]))

    def _queue(self, gateway_id: str) -> queue.Queue[OutputBatch]:
        with self._outputs_lock:
            return self._outputs[gateway_id]


RANKS_LOST_EXIT_CODE = 75  # a worker process that left because a rank of its group is lost


def _exit_process(error: BaseException) -> None:
    """Leave at once: the worker cannot step without its ranks, and a process that is gone is
    what the router recovers a worker's requests from (exactly once)."""
    logging.shutdown()
    os._exit(RANKS_LOST_EXIT_CODE)


@dataclass(frozen=True, slots=True)
class _StepOutputs:
    events: defaultdict[str, list[TokenEvent]]  # gateway id -> the step's events for it
    # (gateway id, index in its events, (received, queued)): the first tokens to trace
    first_tokens: list[tuple[str, int, tuple[float, float]]]
