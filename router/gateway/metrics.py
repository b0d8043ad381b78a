"""Prometheus metrics at ``/metrics``: request latencies measured here, worker state from the
router's load reports. Names follow vLLM's with the ``pdserve:`` prefix; label values are
bounded (worker ids and roles come from the cluster, never from a client).

Worker gauges are read from the load reports the router already polls, so ``/metrics`` covers
every worker however many there are, from the one process that serves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from router.cluster import WorkerStatus

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_STATUSES = ("ok", "invalid", "unauthorized", "rejected", "failed", "aborted")


class _WorkerCollector(Collector):
    def __init__(self, statuses: Callable[[], Sequence[WorkerStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterable[Metric]:
        labels = ["role", "worker"]
        running = GaugeMetricFamily(
            "pdserve:num_requests_running", "Sequences in the worker's running batch", labels=labels
        )
        waiting = GaugeMetricFamily(
            "pdserve:num_requests_waiting", "Sequences queued at the worker", labels=labels
        )
        kv_usage = GaugeMetricFamily(
            "pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", labels=labels
        )
        alive = GaugeMetricFamily(
            "pdserve:worker_alive", "1 while the worker is in rotation", labels=labels
        )
        generated = CounterMetricFamily(
            "pdserve:worker_generation_tokens",
            "Tokens the worker sampled since it started",
            labels=labels,
        )
        for status in self._statuses():
            values = [status.role, status.worker_id]
            alive.add_metric(values, 1.0 if status.alive else 0.0)
            if status.load is not None and status.alive:
                running.add_metric(values, status.load.num_running)
                waiting.add_metric(values, status.load.num_waiting)
                kv_usage.add_metric(values, status.load.kv_usage)
                generated.add_metric(values, status.load.num_generated_tokens)
        yield from (running, waiting, kv_usage, alive, generated)


class GatewayMetrics:
    def __init__(self, worker_statuses: Callable[[], Sequence[WorkerStatus]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_WorkerCollector(worker_statuses))
        r = self.registry
        self.requests = Counter("pdserve:requests", "Requests by outcome", ["status"], registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Generated tokens", registry=r
        )
        self.prefix_cache_queries = Counter(
            "pdserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "pdserve:prefix_cache_hits", "Prompt tokens served by the prefix cache", registry=r
        )
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between consecutive tokens of a sample",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(
        self, e2e_seconds: float, num_prompt: int, num_generated: int, num_cached: int
    ) -> None:
        self.e2e_request_latency.observe(e2e_seconds)
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.prefix_cache_queries.inc(num_prompt)
        self.prefix_cache_hits.inc(num_cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
