"""Serving benchmark: load generation against an OpenAI-compatible endpoint, and its report."""

from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, RequestRecord, Summary
from bench.serving.runner import (
    BenchConfig,
    BenchmarkError,
    BenchResult,
    SweepResult,
    run_benchmark,
    run_benchmark_async,
    sweep,
    sweep_async,
)
from bench.serving.workloads import WorkloadSpec

__all__ = [
    "SLO",
    "ArrivalSpec",
    "BenchConfig",
    "BenchResult",
    "BenchmarkError",
    "EndpointConfig",
    "RequestRecord",
    "Summary",
    "SweepResult",
    "WorkloadSpec",
    "run_benchmark",
    "run_benchmark_async",
    "sweep",
    "sweep_async",
]
