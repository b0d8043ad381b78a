"""Admission's feedback from what it admitted (``--admission slo``): the share of admitted
requests that met their SLOs, steered to ``--admission-attainment``.

Admission refuses a request predicted, tail included, to miss its SLOs
(router/gateway/slo_admission.py). Where the predictions are too kind (workers sharing a
host's cores, whose steps slow in spells the latency model does not foresee: two workers per
pool on two cores made 87-91 % of what they admitted against 95 % asked), nothing told
admission so. Here each finished request it admitted says whether it met both SLOs, and
admission's limits are scaled by ``scale``, a stochastic-approximation root finder's estimate
(Robbins-Monro) of the scale at which the share that meets them is the attainment asked:

    scale -= step * (missed - (1 - attainment))      (missed: 1 or 0), within [LOWEST, 1]

A miss lowers it by ``step * attainment``, a request that met both raises it by ``step * (1 -
attainment)``: it settles where misses are ``1 - attainment`` of the requests, lower while
more miss. Never above 1: where the predictions are right or cautious, admission stays as the
SLOs and the tail make it (the feedback only tightens). A request whose TTFT and TPOT were not
both measured (no token, or one) says nothing; nor does the probe (admitted although
predicted to miss, to refresh the corrections).
"""

from __future__ import annotations

import threading

# the scale moves by this much per request, times its share: a miss at 0.95 lowers it by
# 0.019, 19 requests that met both raise it back (docs/benchmarks.md: 0.05 tried)
STEP = 0.02
LOWEST = 0.5  # admission's limits are never below half the SLOs


class AttainmentFeedback:
    """Thread-safe: the gateway's event loop and its parser threads may both call it."""

    def __init__(self, attainment: float, step: float = STEP, lowest: float = LOWEST) -> None:
        if not 0 < attainment < 1:
            raise ValueError(f"attainment must be in (0, 1), got {attainment}")
        if not 0 < step < 1 or not 0 < lowest <= 1:
            raise ValueError(f"step must be in (0, 1) and lowest in (0, 1], got {step}, {lowest}")
        self.attainment = attainment
        self.step = step
        self.lowest = lowest
        self._scale = 1.0
        self._met = self._missed = 0
        self._lock = threading.Lock()

    @property
    def scale(self) -> float:
        """What admission's limits are scaled by now: 1 (as the SLOs and the margin set them)
        down to ``lowest``."""
        with self._lock:
            return self._scale

    def observe(self, met: bool) -> None:
        """An admitted request finished, within both its SLOs or not."""
        missed = 0.0 if met else 1.0
        with self._lock:
            if met:
                self._met += 1
            else:
                self._missed += 1
            moved = self._scale - self.step * (missed - (1 - self.attainment))
            self._scale = min(1.0, max(self.lowest, moved))

    def counts(self) -> tuple[int, int]:
        """(requests observed that met both SLOs, that missed one)."""
        with self._lock:
            return self._met, self._missed
