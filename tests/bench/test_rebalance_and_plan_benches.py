"""bench.rebalance's and bench.plan_accuracy's pure parts: phases' outcomes and their overall
goodput; a measured run against its simulation, and the goodput error."""

from __future__ import annotations

from bench.plan_accuracy import compare, table
from bench.rebalance import PhaseOutcome, overall_goodput, phase_outcome
from bench.rebalance import table as phases_table
from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, RequestRecord, summarize
from bench.serving.runner import BenchConfig, BenchResult
from router.planner.plan import Slo
from router.planner.simulator import SimulatedRequest, WorkloadRequest

BOUNDS = SLO(ttft_ms=100, tpot_ms=20)


def _record(index: int, ttft_s: float) -> RequestRecord:
    return RequestRecord(
        index,
        100,
        10,
        True,
        ttft_s=ttft_s,
        e2e_s=ttft_s + 0.09,
        itl_s=(0.01,) * 9,
        output_tokens=10,
    )


def _result(records: list[RequestRecord], rate: float) -> BenchResult:
    config = BenchConfig(
        EndpointConfig("http://127.0.0.1:1/v1", "m"),
        "unused",
        arrivals=ArrivalSpec(rate),
        slo=BOUNDS,
    )
    return BenchResult(config, summarize(records, 10.0, BOUNDS), tuple(records), "now")


def test_a_phase_counts_good_requests_and_the_phases_add_up() -> None:
    records = [_record(i, 0.05) for i in range(8)] + [_record(8, 0.5), _record(9, 0.5)]
    a = phase_outcome("fixed", "A", 0, _result(records, 1.0))
    assert (a.num_sent, a.num_good, a.attainment, a.goodput) == (10, 8, 0.8, 0.8)
    b = PhaseOutcome("fixed", "B", 0, 1.0, 10, 10, 2, 10.0, 50.0, 10.0)
    assert overall_goodput([a, b]) == 0.5  # 10 good in 20 s
    # a second round's phases add in: 10 + 4 good in 20 + 20 s
    again = [PhaseOutcome("fixed", phase, 1, 1.0, 10, 10, 2, 10.0, None, None) for phase in "AB"]
    assert overall_goodput([a, b, *again]) == 14 / 40
    printed = phases_table([a, b, *again])
    assert "fixed" in printed and " round " in printed


def test_a_simulation_is_compared_with_its_measured_run() -> None:
    records = [_record(i, 0.05 if i < 6 else 0.3) for i in range(10)]
    simulated = []
    for i in range(10):
        run = SimulatedRequest(WorkloadRequest(0.0, (1,) * 100, 10))
        run.first_token_s, run.last_token_s, run.num_tokens = 0.05 if i < 8 else 0.3, 0.14, 10
        if i >= 8:
            run.last_token_s = 0.39
        simulated.append(run)
    comparison = compare("1p1d", 5.0, _result(records, 5.0), simulated, Slo(0.1, 0.02))
    assert comparison.measured_goodput == 3.0  # 6 of 10 within the SLOs at 5/s
    assert comparison.predicted_goodput == 4.0  # 8 of 10
    assert comparison.goodput_error == (4.0 - 3.0) / 3.0
    assert "+33%" in table([comparison])
