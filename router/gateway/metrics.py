"""Prometheus metrics at ``/metrics``, names following vLLM's with the ``pdserve:`` prefix.

Two sources, one endpoint:
- request-level histograms and counters measured here, at the gateway (TTFT, inter-token
  latency, time per output token, end-to-end and queue time, per prompt; generation requests
  by outcome; prompts sent to the cluster; tokens; goodput as ``slo_met_total``, the requests
  whose every prompt met the configured TTFT and TPOT targets; the time each prompt's first
  token spent in each hop of its path, ``first_token_hop_seconds{hop}``, from its trace; the
  latencies the router predicted for each prompt at admission, ``predicted_*_seconds``, and how
  far the observed ones were from them, ``latency_prediction_ratio{slo}`` (observed over
  predicted); requests refused by ``--admission slo``, ``admission_refusals_total{reason}``,
  and let in as probes, ``admission_probes_total``);
- worker-level gauges and counters labelled ``role`` and ``worker``, read at scrape time from
  the load reports the router already polls from every worker (running, waiting, KV usage,
  prefix-cache hit rate and hits by tier, bytes moved to and from a host tier, preemptions, KV transfer bytes and seconds, speculative decoding's draft
  tokens and those accepted; a mixture-of-experts model's tokens per expert and each sparse
  layer's imbalance). So ``/metrics`` covers every worker, however many there are,
  without Ray's metrics export.

Label values are bounded: worker ids and roles come from the cluster; statuses and hops from
fixed sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from engine.messages.first_token import HOPS, FirstTokenTrace
from router.gateway.slo_admission import REFUSAL_REASONS
from router.kv_aware import HIT_TOKEN_BUCKETS, PrefixHitStats
from router.latency_forecast import Forecast
from router.latency_model import PREDICTION_RATIO_BUCKETS, StepRatios

if TYPE_CHECKING:
    from router.cluster import SlotRestarts, WorkerStatus
    from router.gateway.text_stream import FinishedGeneration

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# a first token's hops: a thread hand-over takes tens of microseconds, a queue seconds
_HOP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
REQUEST_STATUSES = ("ok", "invalid", "unauthorized", "rejected", "failed", "aborted")
# observed over predicted latency: 1 is a perfect prediction


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft_s: float = 1.0  # a request meets its SLO when its time to first token is at most this
    tpot_s: float = 0.1  # ... and its mean time per output token at most this

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLO targets must be > 0 (--slo-ttft-ms, --slo-tpot-ms)")


class _WorkerCollector(Collector):
    def __init__(self, statuses: Callable[[], Sequence[WorkerStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterable[Metric]:
        labels = ["role", "worker"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pdserve:{name}", doc, labels=labels)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)

        alive = gauge("worker_alive", "1 while the worker is in rotation")
        running = gauge("num_requests_running", "Sequences in the worker's running batch")
        waiting = gauge("num_requests_waiting", "Sequences queued at the worker")
        kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries since start")
        generated = counter("worker_generation_tokens", "Tokens the worker sampled")
        prefilled = counter(
            "worker_prefill_tokens", "Prompt (and recomputed) tokens the worker computed"
        )
        preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks")
        steps = counter("worker_steps", "Engine steps the worker ran (that ran the model)")
        step_seconds = counter("worker_step_seconds", "Wall time of those steps: its busy time")
        step_cpu = counter(
            "worker_step_thread_cpu_seconds",
            "CPU time of the worker's engine thread in those steps (below their wall time by "
            "what waits took: the device, a shared host's other work)",
        )
        process_cpu = counter(
            "worker_process_cpu_seconds",
            "CPU time of the worker's process (its first rank's), all its threads: its steps, "
            "the outputs it streams, its calls and KV hand-offs",
        )
        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        hits_by_tier = CounterMetricFamily(
            "pdserve:prefix_cache_hits_by_tier",
            "Prompt tokens found in the prefix cache, by the tier that held them (host: the "
            "--kv-offload-gb tier, copied back)",
            labels=[*labels, "tier"],
        )
        offload_bytes = CounterMetricFamily(
            "pdserve:kv_offload_bytes",
            "KV bytes copied between the device cache and the host tier (to_host: evicted "
            "blocks kept; to_device: host hits brought back)",
            labels=[*labels, "direction"],
        )
        transfer_bytes = counter("kv_transfer_bytes", "KV bytes sent (prefill) or received")
        attempts = counter(
            "spec_decode_num_draft_attempts",
            "Speculative decoding: the times a decoding sequence asked for drafts",
        )
        proposals = counter(
            "spec_decode_num_drafts", "Of those, the times it got drafts (its step checked them)"
        )
        drafts = counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens the worker checked"
        )
        accepted = counter(
            "spec_decode_num_accepted_tokens", "Of those draft tokens, the ones that stood"
        )
        transfer_seconds = SummaryMetricFamily(
            "pdserve:kv_transfer_seconds", "Wall time of KV transfers", labels=labels
        )
        expert_tokens = CounterMetricFamily(
            "pdserve:moe_expert_tokens",
            "Mixture-of-experts models: tokens routed to each expert, over all sparse layers",
            labels=[*labels, "expert"],
        )
        imbalance = GaugeMetricFamily(
            "pdserve:moe_layer_imbalance",
            "Mixture-of-experts models: a sparse layer's busiest expert's tokens over the mean "
            "per expert, since the worker started (1 is an even spread)",
            labels=[*labels, "layer"],
        )
        for status in self._statuses():
            values = [status.role, status.worker_id]
            alive.add_metric(values, 1.0 if status.alive else 0.0)
            if status.load is None or not status.alive:
                continue
            load, totals = status.load, status.load.counters
            running.add_metric(values, load.num_running)
            waiting.add_metric(values, load.num_waiting)
            kv_usage.add_metric(values, load.kv_usage)
            queried = totals.num_prefix_cache_queried_tokens
            hit_rate.add_metric(
                values, totals.num_prefix_cache_hit_tokens / queried if queried else 0.0
            )
            generated.add_metric(values, totals.num_generated_tokens)
            prefilled.add_metric(values, totals.num_prefill_tokens)
            preemptions.add_metric(values, totals.num_preemptions)
            steps.add_metric(values, totals.num_steps)
            step_seconds.add_metric(values, totals.step_seconds)
            step_cpu.add_metric(values, totals.step_thread_cpu_seconds)
            process_cpu.add_metric(values, totals.process_cpu_seconds)
            queries.add_metric(values, queried)
            hits.add_metric(values, totals.num_prefix_cache_hit_tokens)
            host_hits = totals.num_prefix_cache_host_hit_tokens
            hits_by_tier.add_metric(
                [*values, "device"], totals.num_prefix_cache_hit_tokens - host_hits
            )
            hits_by_tier.add_metric([*values, "host"], host_hits)
            offload_bytes.add_metric([*values, "to_host"], totals.num_kv_offloaded_bytes)
            offload_bytes.add_metric([*values, "to_device"], totals.num_kv_loaded_bytes)
            transfer_bytes.add_metric(values, totals.num_kv_transfer_bytes)
            transfer_seconds.add_metric(
                values, count_value=totals.num_kv_transfers, sum_value=totals.kv_transfer_seconds
            )
            attempts.add_metric(values, totals.num_draft_attempts)
            proposals.add_metric(values, totals.num_drafts)
            drafts.add_metric(values, totals.num_draft_tokens)
            accepted.add_metric(values, totals.num_accepted_draft_tokens)
            for expert, count in enumerate(totals.expert_tokens):
                expert_tokens.add_metric([*values, str(expert)], count)
            for layer, ratio in totals.expert_layer_imbalance:
                imbalance.add_metric([*values, str(layer)], ratio)
        yield from (alive, running, waiting, kv_usage, hit_rate, generated, prefilled, preemptions)
        yield from (queries, hits, hits_by_tier, offload_bytes, transfer_bytes, transfer_seconds)
        yield from (attempts, proposals, drafts, accepted)
        yield from (steps, step_seconds, step_cpu, process_cpu)
        yield from (expert_tokens, imbalance)


class _RouterCollector(Collector):
    """The router's own counts: prompts it had decode workers prefill, by reason, workers
    started in a slot of a pool after its first one died, workers ``--rebalance`` moved between
    the pools, and (kv_aware) the cached tokens of the prompts it routed."""

    def __init__(
        self,
        local_prefills: Callable[[], Mapping[str, int]],
        worker_restarts: Callable[[], Sequence[SlotRestarts]],
        prefix_hit_stats: Callable[[], PrefixHitStats | None],
        role_switches: Callable[[], Mapping[tuple[str, str], int]],
        step_prediction_ratios: Callable[[], Mapping[str, StepRatios]],
    ) -> None:
        self._local_prefills = local_prefills
        self._worker_restarts = worker_restarts
        self._prefix_hit_stats = prefix_hit_stats
        self._role_switches = role_switches
        self._step_prediction_ratios = step_prediction_ratios

    def collect(self) -> Iterable[Metric]:
        local = CounterMetricFamily(
            "pdserve:local_prefills",
            "Prompts prefilled on their decode worker (short: by length; backlog: the prefill "
            "pool was backed up; cached: the decode worker held most of the prompt already)",
            labels=["reason"],
        )
        for reason, count in self._local_prefills().items():
            local.add_metric([reason], count)
        restarts = CounterMetricFamily(
            "pdserve:worker_restarts",
            "Workers started in a slot of a pool after its first one's process died",
            labels=["role", "slot"],
        )
        for slot in self._worker_restarts():
            restarts.add_metric([slot.role, slot.slot], slot.restarts)
        switches = CounterMetricFamily(
            "pdserve:role_switches",
            "Workers --rebalance moved from one pool to the other",
            labels=["from_role", "to_role"],
        )
        counts = self._role_switches()
        for from_role, to_role in (("prefill", "decode"), ("decode", "prefill")):
            switches.add_metric([from_role, to_role], counts.get((from_role, to_role), 0))
        yield from (local, restarts, switches)
        yield from _step_ratio_metrics(self._step_prediction_ratios())
        stats = self._prefix_hit_stats()
        if stats is not None:
            yield from _prefix_hit_metrics(stats)


def _step_ratio_metrics(by_role: Mapping[str, StepRatios]) -> Iterable[Metric]:
    """Each role's reported steps' time over the latency model's prediction, a histogram per
    role (one family)."""
    family = HistogramMetricFamily(
        "pdserve:step_time_prediction_ratio",
        "A worker's engine step's time over what the router's latency model predicted for it "
        "when the step was reported (1: exact; docs/slo-admission.md)",
        labels=["role"],
    )
    for role, ratios in sorted(by_role.items()):
        buckets = _cumulative(PREDICTION_RATIO_BUCKETS, ratios.bucket_counts)
        family.add_metric([role], buckets, ratios.sum_ratio)
    yield family


def _cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """A histogram's buckets as Prometheus has them, (upper bound, count at most it), from the
    counts per bucket of ``bounds`` and one over the last."""
    cumulative, buckets = 0.0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    return buckets


def _prefix_hit_metrics(stats: PrefixHitStats) -> Iterable[Metric]:
    """kv_aware's routed prompts: their cached tokens on the chosen worker, as a histogram of
    hit tokens per routed request and a count per tier."""
    buckets = _cumulative(HIT_TOKEN_BUCKETS, stats.bucket_counts)
    per_request = HistogramMetricFamily(
        "pdserve:routed_prefix_hit_tokens",
        "kv_aware: prompt tokens the chosen prefill worker holds in cache (device or host), "
        "per routed request",
        buckets=buckets,
        sum_value=stats.device_hit_tokens + stats.host_hit_tokens,
    )
    by_tier = CounterMetricFamily(
        "pdserve:routed_prefix_hit_tokens_by_tier",
        "kv_aware: prompt tokens the chosen prefill worker holds, by the tier they are in",
        labels=["tier"],
    )
    by_tier.add_metric(["device"], stats.device_hit_tokens)
    by_tier.add_metric(["host"], stats.host_hit_tokens)
    fetches = CounterMetricFamily(
        "pdserve:routed_prefix_fetches",
        "kv_aware: prompts whose prefill worker first copies their prefix's KV from the decode "
        "worker caching it",
    )
    fetches.add_metric([], stats.num_fetches)
    fetched = CounterMetricFamily(
        "pdserve:routed_prefix_fetch_tokens",
        "kv_aware: prompt tokens whose KV prefill workers were sent to copy from decode workers",
    )
    fetched.add_metric([], stats.fetched_tokens)
    yield from (per_request, by_tier, fetches, fetched)


class GatewayMetrics:
    def __init__(
        self,
        worker_statuses: Callable[[], Sequence[WorkerStatus]],
        local_prefills: Callable[[], Mapping[str, int]],
        worker_restarts: Callable[[], Sequence[SlotRestarts]],
        slo: SloTargets,
        model_info: Mapping[str, str] | None = None,
        prefix_hit_stats: Callable[[], PrefixHitStats | None] = lambda: None,
        role_switches: Callable[[], Mapping[tuple[str, str], int]] = dict,
        step_prediction_ratios: Callable[[], Mapping[str, StepRatios]] = dict,
    ) -> None:
        """``model_info``: labels of ``pdserve:model_info`` (the served model's name, its
        weights' quantization and what its KV cache stores), a gauge of 1 as Prometheus info
        metrics are."""
        self.slo = slo
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_WorkerCollector(worker_statuses))
        self.registry.register(
            _RouterCollector(
                local_prefills,
                worker_restarts,
                prefix_hit_stats,
                role_switches,
                step_prediction_ratios,
            )
        )
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, buckets=buckets, registry=r)

        if model_info is not None:
            info = Gauge(
                "pdserve:model_info",
                "The served model: its name, its weights' quantization ('none': floats) and "
                "its KV cache's element type",
                sorted(model_info),
                registry=r,
            )
            info.labels(**model_info).set(1)
        self.requests = Counter(
            "pdserve:requests", "Generation requests by outcome", ["status"], registry=r
        )
        self.prompts = Counter(
            "pdserve:prompts", "Prompts of admitted requests sent to the cluster", registry=r
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Generated tokens delivered", registry=r
        )
        self.slo_met = Counter(
            "pdserve:slo_met",
            "Requests finished ok whose every prompt met both SLOs (goodput, in requests)",
            registry=r,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Gap between a sample's tokens", _TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Mean gap per request after its first token",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Waiting at the first worker", _LATENCY_BUCKETS
        )
        hops = Histogram(
            "pdserve:first_token_hop_seconds",
            "Time a prompt's first token spent in each hop of its path, from the request's "
            "arrival to its first chunk written (docs/request_path.md)",
            ["hop"],
            buckets=_HOP_BUCKETS,
            registry=r,
        )
        self._first_token_hops = {hop: hops.labels(hop=hop) for hop in HOPS}
        self.predicted_time_to_first_token = histogram(
            "predicted_time_to_first_token_seconds",
            "Time to first token the router predicted for a prompt at admission",
            _LATENCY_BUCKETS,
        )
        self.predicted_time_per_output_token = histogram(
            "predicted_time_per_output_token_seconds",
            "Time per output token the router predicted for a prompt at admission",
            _TOKEN_LATENCY_BUCKETS,
        )
        ratios = Histogram(
            "pdserve:latency_prediction_ratio",
            "A finished prompt's observed latency over the router's prediction (1: exact)",
            ["slo"],
            buckets=PREDICTION_RATIO_BUCKETS,
            registry=r,
        )
        self._prediction_ratios = {slo: ratios.labels(slo=slo) for slo in ("ttft", "tpot")}
        self.admission_refusals = Counter(
            "pdserve:admission_refusals",
            "Requests refused by --admission slo, by reason (ttft, tpot: predicted to miss "
            "that SLO; warming_up: more in flight than a model that has seen few requests "
            "finish vouches for; fair_share: the key held more than its share of a loaded "
            "server)",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.admission_refusals.labels(reason=reason)
        self.admission_probes = Counter(
            "pdserve:admission_probes",
            "Requests --admission slo let in although predicted to miss, one at a time, as "
            "probes: nothing queued ahead, the steps alone within the SLOs, only the path's "
            "corrections (learned from earlier requests) against",
            registry=r,
        )
        self.admission_scale = Gauge(
            "pdserve:admission_slo_scale",
            "What --admission slo scales the SLOs by when it judges a request: 1, or less "
            "while fewer of the requests it admitted met their SLOs than "
            "--admission-attainment asks (router/gateway/attainment_feedback.py)",
            registry=r,
        )
        self.admission_scale.set(1.0)  # (until the gateway reads it from its feedback)
        targets = Gauge("pdserve:slo_target_seconds", "SLO targets", ["slo"], registry=r)
        targets.labels(slo="ttft").set(slo.ttft_s)
        targets.labels(slo="tpot").set(slo.tpot_s)
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def first_token_traced(self, trace: FirstTokenTrace) -> None:
        """Observe each hop of a first token's trace (a hop between clocks that disagree, on
        two nodes, counts as 0 when it came out negative)."""
        for hop, seconds in trace.hops().items():
            self._first_token_hops[hop].observe(max(0.0, seconds))

    def finished(self, generations: Sequence[FinishedGeneration]) -> bool | None:
        """One request ended normally: each prompt's latencies and tokens; goodput when every
        prompt met both SLOs (so that goodput and ``requests_total{status="ok"}`` agree).
        Whether it met them; None where a prompt had no token (no latency to judge)."""
        met = [self._prompt_finished(generation) for generation in generations]  # each one
        if all(met):
            self.slo_met.inc()
        if any(g.time_to_first_token is None for g in generations):
            return None
        return all(met)

    def _prompt_finished(self, generation: FinishedGeneration) -> bool:
        """Record one prompt's latencies and tokens; whether it met both SLOs."""
        self.e2e_request_latency.observe(generation.e2e_seconds)
        self.request_queue_time.observe(generation.queue_seconds)
        self.prompt_tokens.inc(generation.num_prompt_tokens)
        self.generation_tokens.inc(generation.num_completion_tokens)
        ttft, tpot = generation.time_to_first_token, generation.time_per_output_token
        if ttft is None or tpot is None:
            return False  # no token arrived
        self.time_per_output_token.observe(tpot)
        forecast = generation.forecast
        if forecast is not None:
            if forecast.ttft_s > 0:
                self._prediction_ratios["ttft"].observe(ttft / forecast.ttft_s)
            if forecast.tpot_s > 0 and tpot > 0:  # (a prompt of one token has no gap)
                self._prediction_ratios["tpot"].observe(tpot / forecast.tpot_s)
        return ttft <= self.slo.ttft_s and tpot <= self.slo.tpot_s

    def predicted(self, forecast: Forecast) -> None:
        """A prompt's latencies as the router predicted them at its admission."""
        self.predicted_time_to_first_token.observe(forecast.ttft_s)
        self.predicted_time_per_output_token.observe(forecast.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
