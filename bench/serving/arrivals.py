"""When requests are sent: gamma-distributed inter-arrival times, or all at once.

With ``request_rate`` R and ``burstiness`` B the gaps between sends are Gamma(shape=B,
scale=1/(R*B)): mean 1/R whatever B, coefficient of variation 1/sqrt(B). B=1 is a Poisson
process; B<1 is burstier, B>1 steadier (vLLM's benchmark_serving draws them the same way).
``request_rate=inf`` sends everything at time 0; ``max_concurrency`` then bounds how many are
in flight, which makes it a closed loop of that many clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    request_rate: float = math.inf  # mean requests per second; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times (1 = Poisson)
    max_concurrency: int | None = None  # requests in flight at most; None = unbounded

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


def inter_arrival_times(spec: ArrivalSpec, num_requests: int, seed: int) -> list[float]:
    """Seconds to wait before each request, the first one included (0 for rate inf)."""
    if math.isinf(spec.request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    scale = 1.0 / (spec.request_rate * spec.burstiness)
    return [float(gap) for gap in rng.gamma(spec.burstiness, scale, size=num_requests)]


def send_offsets(spec: ArrivalSpec, num_requests: int, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (cumulative gaps)."""
    return [float(t) for t in np.cumsum(inter_arrival_times(spec, num_requests, seed))]
