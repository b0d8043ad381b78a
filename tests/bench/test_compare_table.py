"""bench.compare's side-by-side table: medians over rounds, and the share of requests in SLO."""

from __future__ import annotations

import pytest

from bench.compare import Row, _table
from bench.serving.metrics import SLO, RequestRecord, Summary, summarize


def _summary(num_good: int, num_slow: int, duration_s: float) -> Summary:
    """A round of ``num_good`` requests within a 500 ms TTFT SLO and ``num_slow`` over it."""
    records = [
        RequestRecord(
            i, 10, 5, success=True, ttft_s=0.1 if i < num_good else 0.9, e2e_s=1.0, output_tokens=5
        )
        for i in range(num_good + num_slow)
    ]
    return summarize(records, duration_s, SLO(ttft_ms=500, tpot_ms=1000))


def test_the_table_gives_each_systems_median_share_of_requests_in_slo() -> None:
    # all in SLO in two of three rounds, whose lengths (and so goodputs) differ
    disaggregated = Row(
        "pdserve 1P1D", 12, (_summary(10, 0, 10), _summary(9, 1, 8), _summary(10, 0, 12))
    )
    colocated = Row(
        "pdserve colocated x2", 12, (_summary(8, 2, 10), _summary(9, 1, 8), _summary(7, 3, 7))
    )
    assert disaggregated.slo_attainment == pytest.approx(1.0)
    assert colocated.slo_attainment == pytest.approx(0.8)
    assert disaggregated.goodput == pytest.approx(1.0)  # 10/10, 9/8, 10/12
    assert colocated.goodput == pytest.approx(1.0)  # 8/10, 9/8, 7/7
    lines = {line.split("  ")[0]: line for line in _table([disaggregated, colocated]).splitlines()}
    assert "100.0%" in lines["pdserve 1P1D"]
    assert "80.0%" in lines["pdserve colocated x2"]
    assert "in SLO" in lines["system"]
