"""Arrival times: gamma gaps with mean 1/R (any burstiness), all at once for rate inf."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.serving.arrivals import ArrivalSpec, inter_arrival_times, send_offsets


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate(burstiness: float) -> None:
    gaps = np.asarray(inter_arrival_times(ArrivalSpec(8.0, burstiness), 20_000, seed=0))
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    # coefficient of variation 1/sqrt(B): Poisson's is 1, burstier above, steadier below
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_gaps_are_seeded() -> None:
    spec = ArrivalSpec(2.0)
    assert inter_arrival_times(spec, 50, seed=1) == inter_arrival_times(spec, 50, seed=1)
    assert inter_arrival_times(spec, 50, seed=1) != inter_arrival_times(spec, 50, seed=2)


def test_offsets_are_cumulative_gaps() -> None:
    spec = ArrivalSpec(5.0, 2.0)
    gaps = inter_arrival_times(spec, 100, seed=3)
    offsets = send_offsets(spec, 100, seed=3)
    assert offsets == pytest.approx(list(np.cumsum(gaps)))
    assert offsets == sorted(offsets)


def test_infinite_rate_sends_everything_at_once() -> None:
    spec = ArrivalSpec(math.inf, max_concurrency=4)
    assert inter_arrival_times(spec, 10, seed=0) == [0.0] * 10
    assert send_offsets(spec, 10, seed=0) == [0.0] * 10
    assert send_offsets(spec, 0, seed=0) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"request_rate": 0.0}, {"request_rate": -1.0}, {"burstiness": 0.0}, {"max_concurrency": 0}],
)
def test_bad_arrival_specs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ArrivalSpec(**kwargs)  # type: ignore[arg-type]
