"""bench.admission's pure parts: a run's outcome (429s are refused, not completed), the
attainment of accepted and of all requests, goodput, and the goals."""

from __future__ import annotations

import pytest

from bench.admission import Outcome, goals, main, outcome, pooled, table
from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, RequestRecord, summarize
from bench.serving.runner import BenchConfig, BenchResult

SLO_BOUNDS = SLO(ttft_ms=100, tpot_ms=20)


def _record(index: int, *, refused: bool = False, ttft_s: float = 0.05) -> RequestRecord:
    if refused:
        return RequestRecord(index, 100, 10, False, "HTTP 429: predicted ... retry later")
    gaps = (0.01,) * 9
    return RequestRecord(
        index, 100, 10, True, ttft_s=ttft_s, e2e_s=ttft_s + 0.09, itl_s=gaps, output_tokens=10
    )


def _result(records: list[RequestRecord], rate: float = 8.0) -> BenchResult:
    config = BenchConfig(
        EndpointConfig("http://127.0.0.1:1/v1", "m"),
        "unused",
        arrivals=ArrivalSpec(rate),
        slo=SLO_BOUNDS,
    )
    return BenchResult(config, summarize(records, 10.0, SLO_BOUNDS), tuple(records), "now")


def test_refused_requests_count_as_sent_not_accepted() -> None:
    records = [_record(i) for i in range(6)] + [_record(6, ttft_s=0.5)]
    records += [_record(i, refused=True) for i in range(7, 10)]
    run = outcome("admission slo", _result(records))
    assert (run.num_sent, run.num_refused, run.num_completed, run.num_good) == (10, 3, 7, 6)
    assert run.attainment_of_accepted == 6 / 7
    assert run.attainment_of_all == 0.6
    assert run.goodput == 0.6  # 6 good over the 10 s run
    # the slow one missed its TTFT, sent in the run's first second
    assert (run.num_ttft_missed, run.num_tpot_missed, run.num_missed_early) == (1, 0, 1)
    assert "admission slo" in table([run]) and "1/0/1" in table([run])


def test_the_goals_compare_attainment_and_goodput() -> None:
    baseline = Outcome("admission none", 8.0, 10, 0, 10, 3, 10.0, 300.0, 900.0)
    guarded = Outcome("admission slo", 8.0, 10, 4, 6, 6, 10.0, 50.0, 90.0)
    attained, goodput = goals(baseline, guarded)
    assert attained["met"] and attained["value"] == 1.0
    assert goodput["met"] and goodput["value"] == 2.0
    worse = Outcome("admission slo", 8.0, 10, 2, 8, 5, 10.0, 50.0, 500.0)
    assert not goals(baseline, worse)[0]["met"]  # 5 of 8 accepted


def test_repeated_runs_pool_their_requests_and_time() -> None:
    runs = [
        Outcome("admission slo #1", 8.0, 10, 4, 6, 6, 10.0, 50.0, 90.0),
        Outcome("admission slo #2", 8.0, 10, 2, 8, 5, 12.0, 60.0, 400.0, 2, 1, 2),
    ]
    both = pooled("admission slo", runs)
    assert (both.num_sent, both.num_refused, both.num_completed, both.num_good) == (20, 6, 14, 11)
    assert both.attainment_of_accepted == 11 / 14
    assert both.goodput == 11 / 22
    assert (both.num_ttft_missed, both.num_tpot_missed, both.num_missed_early) == (2, 1, 2)
    assert both.ttft_p50_ms is None and "admission slo" in table([both])


def test_no_run_of_the_admission_server_is_refused_before_any_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
