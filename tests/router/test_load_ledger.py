"""The router's view of a worker's load: a report plus the requests it may not show yet."""

from __future__ import annotations

from engine.messages import WorkerLoad
from router.load_ledger import LoadLedger


def _report(num_running: int = 0, num_queued_prompt_tokens: int = 0) -> WorkerLoad:
    return WorkerLoad("decode-0", 0, num_running, num_queued_prompt_tokens, 0.0)


def _open(request_id: str) -> bool:
    return True


def _ledger_routed_a() -> LoadLedger:
    """A ledger with an empty report, then request "a" (one sequence) routed to its worker."""
    ledger = LoadLedger()
    ledger.record(_report(), 0.0, _open)
    ledger.charge("a", num_sequences=1)
    return ledger


def _running(ledger: LoadLedger) -> int:
    load = ledger.load
    assert load is not None
    return load.num_running


def test_no_load_before_the_first_report() -> None:
    ledger = LoadLedger()
    ledger.charge("a", num_sequences=1)
    assert ledger.load is None


def test_routed_requests_add_to_the_report() -> None:
    ledger = LoadLedger()
    ledger.record(_report(num_running=2, num_queued_prompt_tokens=10), 0.0, _open)
    ledger.charge("a", num_sequences=2)
    ledger.charge("b", num_prompt_tokens=30)
    load = ledger.load
    assert load is not None
    assert (load.num_running, load.num_queued_prompt_tokens) == (4, 40)


def test_a_report_does_not_cancel_a_request_still_waiting_at_the_worker() -> None:
    ledger = _ledger_routed_a()
    ledger.record(_report(num_running=0), 5.0, _open)  # taken while "a" waits to be accepted
    assert _running(ledger) == 1


def test_a_report_asked_for_before_the_worker_held_the_request_keeps_it() -> None:
    ledger = _ledger_routed_a()
    ledger.mark_held("a", 10.0)
    ledger.record(_report(num_running=0), 9.0, _open)
    assert _running(ledger) == 1


def test_a_report_asked_for_after_the_worker_held_the_request_replaces_it() -> None:
    ledger = _ledger_routed_a()
    ledger.mark_held("a", 10.0)
    ledger.mark_held("a", 20.0)  # the first time counts
    ledger.record(_report(num_running=1), 11.0, _open)
    assert _running(ledger) == 1
    assert ledger.num_charges == 0


def test_an_ended_request_stops_counting_at_the_next_report() -> None:
    ledger = _ledger_routed_a()
    ledger.charge("b", num_sequences=1)
    ledger.record(_report(), 1.0, lambda request_id: request_id != "a")
    assert _running(ledger) == 1


def test_routing_a_request_again_replaces_or_drops_its_charge() -> None:
    ledger = _ledger_routed_a()
    ledger.charge("a", num_sequences=3)
    assert _running(ledger) == 3
    ledger.drop("a")
    assert _running(ledger) == 0


def test_drop_all_forgets_every_charge() -> None:
    ledger = _ledger_routed_a()
    ledger.charge("b", num_prompt_tokens=5)
    ledger.drop_all()
    assert ledger.num_charges == 0 and _running(ledger) == 0
