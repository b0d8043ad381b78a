"""Timing a callable for benchmarks: the median of repeated calls after a few warm-up calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmups: int = 3) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, after ``warmups`` untimed ones."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
