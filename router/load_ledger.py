"""What the router takes a worker's load to be: its latest report, plus the requests routed to
it that the report may not show yet.

A request counts towards its worker from the moment it is routed. It stops being added on top
of the reports once a report asked for *after* the worker was known to hold it has come back
(that report shows it), or once the request has ended (dropped then, not at the next report: a
conversation's next turn, sent as the last one ends, must not see it queued still). Until then a report cannot cancel it: a
worker accepts requests only between engine steps, so a report taken mid-step does not show
the requests still waiting at its door, and routing by it alone sent a burst to one worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.messages import WorkerLoad


@dataclass(slots=True)
class _Charge:
    num_sequences: int  # added to the report's num_running
    num_prompt_tokens: int  # added to the report's num_queued_prompt_tokens
    num_context_tokens: int  # added to the report's num_context_tokens
    held_since: float | None = None  # monotonic time the worker was known to hold it


class LoadLedger:
    """One worker's load as the router sees it. Not thread-safe: the router's lock guards it."""

    def __init__(self) -> None:
        self.report: WorkerLoad | None = None  # the latest report, as the worker sent it
        self._charges: dict[str, _Charge] = {}  # by request id

    def charge(
        self,
        request_id: str,
        *,
        num_sequences: int = 0,
        num_prompt_tokens: int = 0,
        num_context_tokens: int = 0,
    ) -> None:
        """Count a request routed here (replacing an earlier charge for the same request):
        its sequences running, its prompt tokens queued, the KV its sequences' decode steps
        read."""
        self._charges[request_id] = _Charge(num_sequences, num_prompt_tokens, num_context_tokens)

    def mark_held(self, request_id: str, now: float) -> None:
        """The worker holds the request from ``now`` on: reports asked for later show it."""
        charge = self._charges.get(request_id)
        if charge is not None and charge.held_since is None:
            charge.held_since = now

    def drop(self, request_id: str) -> None:
        """Forget a request's charge (it is being routed again)."""
        self._charges.pop(request_id, None)

    def drop_all(self) -> None:
        """Forget every charge (the worker is out of rotation: no report will drop them)."""
        self._charges.clear()

    def record(
        self, report: WorkerLoad, requested_at: float, is_open: Callable[[str], bool]
    ) -> None:
        """Take a report asked for at ``requested_at``; ``is_open`` says whether a request
        has not ended yet."""
        self.report = report
        self._charges = {
            request_id: charge
            for request_id, charge in self._charges.items()
            if is_open(request_id)
            and (charge.held_since is None or charge.held_since >= requested_at)
        }

    @property
    def load(self) -> WorkerLoad | None:
        """The latest report with the requests it may not show added; None before a report."""
        if self.report is None or not self._charges:
            return self.report
        charges = self._charges.values()
        return replace(
            self.report,
            num_running=self.report.num_running + sum(c.num_sequences for c in charges),
            num_queued_prompt_tokens=self.report.num_queued_prompt_tokens
            + sum(c.num_prompt_tokens for c in charges),
            num_context_tokens=self.report.num_context_tokens
            + sum(c.num_context_tokens for c in charges),
        )

    @property
    def num_charges(self) -> int:
        return len(self._charges)


def charge_routed(
    request_id: str,
    prefill: LoadLedger | None,
    decode: LoadLedger,
    num_prompt_tokens: int,
    num_sequences: int,
    num_resumed_tokens: int = 0,
) -> None:
    """Count a routed request towards its workers: its prompt queued on the prefill worker
    (None: on the decode worker, which prefills it itself), its sequences running on the decode
    worker, each reading the prompt's KV (and its resumed tokens')."""
    context = num_sequences * num_prompt_tokens + num_resumed_tokens
    if prefill is None:
        decode.charge(
            request_id,
            num_sequences=num_sequences,
            num_prompt_tokens=num_prompt_tokens,
            num_context_tokens=context,
        )
        return
    prefill.charge(request_id, num_prompt_tokens=num_prompt_tokens)
    decode.charge(request_id, num_sequences=num_sequences, num_context_tokens=context)
