"""A request's first token, traced hop by hop from the gateway's front door to the client.

The worker that samples a request's first token fills its stamps in a ``FirstTokenTrace`` and
sends it on the ``TokenEvent`` of sample 0's position 0 (no other event carries one); the router
adds its own as the token passes, and the gateway its last ones once the token is written to
the client. Every stamp is a wall-clock time (``time.time()``) because the hops span processes:
the gateway, the router's threads and the worker. On one node those processes read one clock;
across nodes, a hop between a worker's stamp and a gateway's includes the clocks' skew.

The stamps in the order the first token passes them (``STAMPS``), and the hops between them
(``HOPS``, each named after what it measures and ending at the stamp in the same place):

  arrived        the HTTP route began (before the body was read)
  parsed         parse         the body read, parsed and tokenized (a large one on a parser thread)
  admitted       admit         the gateway admitted it (an in-flight slot)
  entered        enter         handed to the cluster (``Cluster.generate`` started)
  placing        place         a placement thread took it (``Placements.submit``)
  routed         route         the routing policy chose its workers
  submit_sent    register      the placement recorded, the submit call about to be sent
  received       submit        the worker's submit call began (``PrefillWorker.submit``,
                               ``DecodeWorker.submit``; on an actor thread)
  queued         worker_lock   added to the engine (``EngineLoop.submit``), once the worker's
                               locks were taken: the engine's at a step boundary
  step_started   worker_queue  the engine step that sampled its first token began
  step_ended     prefill_step  that step ended
  emitted        emit          the step's output batch put on the gateway's output queue
  streamed       stream        the worker's output stream took the batch off the queue
  pumped         pump          the gateway's output pump thread received the batch
  sunk           dispatch      the token handed to the request's sink (``Placements.dispatch``)
  yielded        event_loop    ``Cluster.generate`` yielded it on the gateway's event loop
  written        write         the first chunk after it written to the client (a streamed
                               response: the SSE event; none for a whole response)

Beside the path (reported, not hops): ``scheduled``, when the engine's scheduler first picked
the prompt (between ``queued`` and ``step_ended``; earlier than ``step_started`` for a prompt
chunked over several steps), and ``submit_returned``, when the submit call's answer reached the
placement thread (the token does not wait for it). A stamp nobody took (a whole response has no
``written``; a resumed request no worker stamps) is None, and the hops next to it are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

STAMPS = (
    "arrived",
    "parsed",
    "admitted",
    "entered",
    "placing",
    "routed",
    "submit_sent",
    "received",
    "queued",
    "step_started",
    "step_ended",
    "emitted",
    "streamed",
    "pumped",
    "sunk",
    "yielded",
    "written",
)
# HOPS[i] runs from STAMPS[i] to STAMPS[i + 1]
HOPS = (
    "parse",
    "admit",
    "enter",
    "place",
    "route",
    "register",
    "submit",
    "worker_lock",
    "worker_queue",
    "prefill_step",
    "emit",
    "stream",
    "pump",
    "dispatch",
    "event_loop",
    "write",
)
SIDE_STAMPS = ("scheduled", "submit_returned")


@dataclass(frozen=True, slots=True)
class FirstTokenTrace:
    worker_id: str  # the worker that sampled the first token
    # the worker's stamps (EngineLoop), filled before the token leaves it
    received_at: float  # the worker's submit call began, on an actor thread
    queued_at: float  # the request added to the engine, under its lock
    # the engine's scheduler first picked it for a step (queued_at plus the engine's queue
    # time, TokenEvent.queue_seconds, which counts from within the add: late by microseconds)
    scheduled_at: float
    step_started_at: float  # the engine step that sampled the first token began
    step_ended_at: float  # ... and ended
    emitted_at: float  # the step's output batch put on the gateway's output queue
    # the router's stamps, filled as the token passes the cluster's threads
    streamed_at: float | None = None  # the worker's output stream took the batch (on the batch)
    pumped_at: float | None = None  # the gateway's output pump thread received the batch
    sunk_at: float | None = None  # handed to the request's sink (Placements.dispatch)
    entered_at: float | None = None  # Cluster.generate began
    placing_at: float | None = None  # a placement thread took it (Placements.submit)
    routed_at: float | None = None  # the routing policy chose its workers
    submit_sent_at: float | None = None  # the submit call about to be sent to the worker
    submit_returned_at: float | None = None  # the submit call's answer reached the router
    yielded_at: float | None = None  # Cluster.generate yielded it, on the event loop
    decode_worker_id: str | None = None  # the router's: the worker that decodes the rest
    # the gateway's stamps, filled when the trace is recorded
    arrived_at: float | None = None  # the HTTP route began
    parsed_at: float | None = None  # the body read, parsed and tokenized
    admitted_at: float | None = None  # the gateway admitted it
    written_at: float | None = None  # the first chunk after it written (streamed responses)

    def stamp(self, name: str) -> float | None:
        """The stamp called ``name`` (one of ``STAMPS`` or ``SIDE_STAMPS``)."""
        value: float | None = getattr(self, f"{name}_at")
        return value

    def stamps(self) -> dict[str, float | None]:
        """Every stamp by name, in path order, then the side stamps."""
        return {name: self.stamp(name) for name in STAMPS + SIDE_STAMPS}

    def hops(self) -> dict[str, float]:
        """Seconds spent in each hop whose two stamps were taken, in path order."""
        hops = {}
        for index, hop in enumerate(HOPS):
            start, end = self.stamp(STAMPS[index]), self.stamp(STAMPS[index + 1])
            if start is not None and end is not None:
                hops[hop] = end - start
        return hops
