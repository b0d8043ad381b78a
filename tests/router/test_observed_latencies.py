"""What a finished prompt teaches the latency model: its TTFT beyond its steps', its later
inter-token gaps beyond its decode steps', and how much longer its first gap (a hand-off's)
was than those."""

from __future__ import annotations

import pytest

from router.latency_forecast import Forecast
from tests.router.test_allowed_placement import _cluster


def test_a_prompts_gaps_are_learned_apart() -> None:
    cluster = _cluster(1, 1)
    model = cluster.pool.latency_model
    forecast = Forecast(0.1, 0.0, "prefill-0", 0.01, "decode-0", 0.0)  # its steps: 100, 10 ms
    cluster.observe_latencies(forecast, 0.15, 0.06, 0.012)
    assert model.recent_path().corrections() == pytest.approx((0.05, 0.002))
    assert model.recent_path().first_gap_excess_s == pytest.approx(0.048)
    two_tokens = _cluster(1, 1)  # one gap: neither the decode's nor the excess is known
    two_tokens.observe_latencies(forecast, 0.15, 0.06, None)
    path = two_tokens.pool.latency_model.recent_path()
    assert path.corrections() == pytest.approx((0.05, 0.0))
    assert path.first_gap_excess_s == 0.0
