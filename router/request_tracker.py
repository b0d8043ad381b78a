"""The gateway's view of one request: its placement, and its tokens in order, exactly once.

Tokens reach the gateway from several workers (the first from a prefill worker, the rest from
a decode worker, more again from a worker that took over after a failure). Each event carries
its position in its sample's output, so the tracker drops duplicates and holds back events
that arrive early until the gap before them fills. The tracker also keeps the times its
placement passed the router's hops (``PlacementStamps``), for its first token's trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.messages import GenerateRequest, RequestFailure, TokenEvent


@dataclass(frozen=True, slots=True)
class RequestDone:
    request_id: str  # every sample of the request has finished


ClientItem = TokenEvent | RequestFailure | RequestDone


@dataclass(slots=True)
class PlacementStamps:
    """Wall-clock times (``time.time()``) at which the placement that is to produce a request's
    first token passed the router's hops (``engine.messages.FirstTokenTrace`` names them);
    written by its placement thread, None until passed."""

    placing_at: float | None = None  # a placement thread took the request
    routed_at: float | None = None  # the routing policy chose its workers
    submit_sent_at: float | None = None  # the submit call about to be sent to the worker
    submit_returned_at: float | None = None  # the worker's answer to it arrived


@dataclass(slots=True)
class RequestTracker:
    request: GenerateRequest
    sink: Callable[[ClientItem], None]  # thread-safe hand-over to the client's stream
    prefill_worker: str | None  # None in colocated mode, or once the prefill phase is over
    decode_worker: str
    delivered: dict[int, list[int]] = field(default_factory=dict)  # sample -> tokens sent
    finished: set[int] = field(default_factory=set)  # samples that ended
    early: dict[tuple[int, int], TokenEvent] = field(default_factory=dict)  # (sample, pos)
    num_retries: int = 0
    closed: bool = False
    placing: bool = False  # a worker is being asked to take it; its workers are not set yet
    candidates: tuple[str, ...] = ()  # while placing: the workers being asked
    held_failure: tuple[RequestFailure, str] | None = None  # (failure, worker) while placing
    # The id the workers know the request by in its current placement (or the one being made):
    # the request id at first, a new one for every later placement, so a placement given up
    # can be told apart from (and aborted without touching) the one that replaced it.
    placement_id: str = ""
    placement_ids: list[str] = field(default_factory=list)  # every one it has had
    stamps: PlacementStamps = field(default_factory=PlacementStamps)  # for its first token

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return len(self.finished) == self.request.params.n

    @property
    def workers(self) -> set[str]:
        """The workers of its current placement (none yet while it is being placed)."""
        return {w for w in (self.prefill_worker, self.decode_worker) if w}

    @property
    def started_decoding(self) -> bool:
        """The prefill phase is over: every sample's first token is out and decoding has begun.
        With n > 1 the prefill worker sends every sample's first token, and a decode worker's
        tokens may overtake them: one sample decoding does not mean the others' are out."""
        n = self.request.params.n
        all_first_tokens_out = all(self.delivered.get(index) for index in range(n))
        return all_first_tokens_out and any(len(tokens) > 1 for tokens in self.delivered.values())

    @property
    def has_delivered(self) -> bool:
        """At least one token reached the client."""
        return any(self.delivered.values())

    def sent_by_its_workers(self, worker_id: str, placement_id: str) -> bool:
        """Whether events from ``worker_id`` about ``placement_id`` belong to the request's
        current placement (or the one being made); a placement given up (its worker stalled,
        or the request moved on) may still send some, and they must not reach the client."""
        if placement_id != self.placement_id:
            return False
        if worker_id in (self.prefill_worker, self.decode_worker):
            return True
        return self.placing and worker_id in self.candidates

    def accept(self, event: TokenEvent) -> None:
        """Take one event from any worker; pass on what is new, in order."""
        if self.closed or event.sample_index in self.finished:
            return
        if event.request_id != self.request_id:  # a later placement's: the client knows one id
            event = replace(event, request_id=self.request_id)
        tokens = self.delivered.setdefault(event.sample_index, [])
        if event.position < len(tokens):
            return  # a duplicate (a retried worker re-sent it)
        self.early[(event.sample_index, event.position)] = event
        while (ready := self.early.pop((event.sample_index, len(tokens)), None)) is not None:
            tokens.append(ready.token_id)
            self.sink(ready)
            if ready.finish_reason is not None:
                self.finished.add(ready.sample_index)
                break
        if self.done:
            self.close(RequestDone(self.request_id))

    def fail(self, message: str) -> None:
        self.close(RequestFailure(self.request_id, message))

    def close(self, item: RequestDone | RequestFailure) -> None:
        if not self.closed:
            self.closed = True
            self.sink(item)

    def resume_request(self) -> GenerateRequest:
        """The request as another worker should continue it: after the tokens already sent.

        Tokens held back from the placement given up are dropped: the new one samples its own.
        """
        self.early.clear()
        request = self.request
        resume = {
            index: list(self.delivered.get(index, []))
            for index in range(request.params.n)
            if index not in self.finished
        }
        # everything else (its salt, its priority ...) as first submitted
        return replace(request, resume_token_ids=resume if any(resume.values()) else {})
