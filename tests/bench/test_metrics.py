"""Metrics math on hand-made records: TPOT, percentiles, throughput, goodput under SLOs."""

from __future__ import annotations

import pytest

from bench.serving.metrics import SLO, RequestRecord, latency_stats, summarize


def _record(
    index: int, ttft_s: float, e2e_s: float, output_tokens: int, **kw: object
) -> RequestRecord:
    return RequestRecord(
        index=index,
        prompt_len=10,
        output_len=output_tokens,
        success=True,
        ttft_s=ttft_s,
        e2e_s=e2e_s,
        output_tokens=output_tokens,
        **kw,  # type: ignore[arg-type]
    )


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert _record(0, 0.1, 1.0, 10).tpot_s == pytest.approx(0.1)
    assert _record(0, 0.1, 0.1, 1).tpot_s is None  # one token: no decode steps
    failed = RequestRecord(0, 10, 5, success=False, error="boom", ttft_s=0.1, e2e_s=1.0)
    assert failed.tpot_s is None


def test_latency_stats_use_linear_interpolation_in_ms() -> None:
    stats = latency_stats([i / 1000 for i in range(1, 101)], (50, 90, 99))  # 1..100 ms
    assert stats.count == 100
    assert stats.mean_ms == pytest.approx(50.5)
    assert stats.percentile(50) == pytest.approx(50.5)
    assert stats.percentile(90) == pytest.approx(90.1)
    assert stats.percentile(99) == pytest.approx(99.01)
    assert stats.percentiles_ms.keys() == {"p50", "p90", "p99"}


def test_latency_stats_of_nothing_are_none() -> None:
    stats = latency_stats([], (50, 99.9))
    assert stats.count == 0 and stats.mean_ms is None
    assert stats.percentiles_ms == {"p50": None, "p99.9": None}


def test_summary_throughputs_and_goodput() -> None:
    records = [
        _record(0, 0.10, 1.00, 10, itl_s=(0.1,) * 9),  # TTFT 100 ms, TPOT 100 ms
        _record(1, 0.30, 0.75, 10, itl_s=(0.05,) * 9),  # TTFT 300 ms, TPOT 50 ms
        _record(2, 0.05, 0.50, 10, itl_s=(0.05,) * 9),  # TTFT 50 ms, TPOT 50 ms
        _record(3, 0.05, 0.05, 1),  # one token: TPOT undefined, meets any TPOT SLO
        RequestRecord(4, 10, 10, success=False, error="HTTP 503: busy", e2e_s=0.01),
    ]
    summary = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=60))
    assert (summary.num_requests, summary.num_completed, summary.num_failed) == (5, 4, 1)
    assert summary.total_input_tokens == 40 and summary.total_output_tokens == 31
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.output_token_throughput == pytest.approx(15.5)
    assert summary.total_token_throughput == pytest.approx(35.5)
    assert summary.num_good == 2  # request 2 and the one-token request 3
    assert summary.goodput == pytest.approx(1.0)
    assert summary.ttft.count == 4 and summary.ttft.mean_ms == pytest.approx(125.0)
    assert summary.tpot.count == 3
    assert summary.tpot.mean_ms == pytest.approx((100 + 50 + 50) / 3)
    assert summary.itl.count == 27
    assert summary.e2e.percentile(50) == pytest.approx(625.0)


def test_slos_bound_only_what_is_given() -> None:
    slow_start = _record(0, 2.0, 2.9, 10)  # TTFT 2 s, TPOT 100 ms
    assert SLO().met_by(slow_start)
    assert SLO(tpot_ms=150).met_by(slow_start)
    assert not SLO(ttft_ms=1000).met_by(slow_start)
    assert not SLO(tpot_ms=50).met_by(slow_start)
    assert not SLO().met_by(RequestRecord(1, 10, 10, success=False))
    no_text = RequestRecord(2, 10, 10, success=True, ttft_s=None, e2e_s=1.0)
    assert SLO().met_by(no_text) and not SLO(ttft_ms=5000).met_by(no_text)


def test_summary_without_slos_counts_every_success_as_good() -> None:
    records = [_record(i, 0.1, 0.5, 5) for i in range(4)]
    summary = summarize(records, duration_s=4.0)
    assert summary.goodput == summary.request_throughput == pytest.approx(1.0)


def test_summary_of_all_failures_has_no_latencies() -> None:
    summary = summarize([RequestRecord(0, 10, 10, success=False, error="x")], duration_s=1.0)
    assert summary.num_completed == 0 and summary.goodput == 0.0
    assert summary.ttft.mean_ms is None and summary.e2e.percentile(99) is None
