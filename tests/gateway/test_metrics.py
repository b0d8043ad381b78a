"""/metrics: every metric the design names is exported, worker counters move with the traffic,
goodput counts only requests whose every prompt met both SLOs, and label values stay bounded."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import WorkerCounters, WorkerLoad
from engine.messages.first_token import HOPS
from engine.messages.kv_events import KV_TIERS
from router.cluster import SlotRestarts, WorkerStatus
from router.gateway.metrics import GatewayMetrics, SloTargets
from router.gateway.server import GatewayServer
from router.gateway.slo_admission import REFUSAL_REASONS
from router.gateway.text_stream import FinishedGeneration
from router.latency_model import StepRatios
from router.local_prefill import LOCAL_PREFILL_REASONS
from tests.gateway.conftest import API_KEYS, MODEL_NAME

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEYS[1]}"}
DESIGN_METRICS = (  # ../shared/DESIGN.md, "Metrics", plus tokens, TPOT and goodput
    "pdserve:time_to_first_token_seconds",
    "pdserve:inter_token_latency_seconds",
    "pdserve:time_per_output_token_seconds",
    "pdserve:e2e_request_latency_seconds",
    "pdserve:request_queue_time_seconds",
    "pdserve:num_requests_running",
    "pdserve:num_requests_waiting",
    "pdserve:kv_cache_usage_perc",
    "pdserve:prefix_cache_queries",
    "pdserve:prefix_cache_hits",
    "pdserve:prefix_cache_hit_rate",
    "pdserve:num_preemptions",
    "pdserve:kv_transfer_bytes",
    "pdserve:kv_transfer_seconds",
    "pdserve:requests",
    "pdserve:slo_met",
    "pdserve:prompt_tokens",
    "pdserve:generation_tokens",
)


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_server.http_url, timeout=120) as client:
        yield client


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value


def _samples(http: httpx.Client) -> Samples:
    text = http.get("/metrics", headers=AUTH).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and labels.items() <= dict(sample_labels).items()
    )


def _settled(http: httpx.Client, until: Callable[[Samples], bool] = lambda _: True) -> Samples:
    """A scrape once the workers are idle, their counters have stopped moving (two scrapes
    half a second apart, several report intervals, agree) and ``until`` holds of it: a busy
    machine's load reports can lag, so it waits on that, for up to 60 s, not on a timer."""
    deadline = time.monotonic() + 60
    last: Samples | None = None
    while True:
        samples = _samples(http)
        idle = _total(samples, "pdserve:num_requests_running") == 0
        counters = {key: value for key, value in samples.items() if _is_counter(key[0])}
        if idle and counters == last and until(samples):
            return samples
        if time.monotonic() > deadline:
            return samples
        last = counters if idle else None
        time.sleep(0.5)


def _is_counter(name: str) -> bool:
    """Whether a sample counts traffic (a worker's CPU seconds move while it idles)."""
    moving = name.endswith("process_cpu_seconds_total")
    return name.endswith(("_total", "_count", "_sum", "_bucket")) and not moving


def test_design_metrics_are_exported_and_move_with_traffic(http: httpx.Client) -> None:
    before = _settled(http)
    rng = random.Random(11)
    prefix = [rng.randrange(3, 1000) for _ in range(32)]  # 4 blocks of 8, shared
    # each prompt's fifth block its own: were the three the same, once the decode worker's
    # events showed it caching the whole first prompt (a report's timing), kv_aware would send
    # a repeat there, or have the prefill worker fetch the block from it, and hand nothing off
    prompts = [prefix + [rng.randrange(3, 1000) for _ in range(8)] for _ in range(3)]
    for prompt in prompts:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200

    def reported(samples: Samples) -> bool:  # the workers' reports of the three are in
        return (
            all(
                _total(samples, "pdserve:kv_transfer_seconds_count", role=role)
                - _total(before, "pdserve:kv_transfer_seconds_count", role=role)
                == 3
                for role in ("prefill", "decode")
            )
            and _total(samples, "pdserve:worker_generation_tokens_total")
            - _total(before, "pdserve:worker_generation_tokens_total")
            == 3 * 6
        )

    after = _settled(http, until=reported)
    names = {name for name, _ in after}
    missing = [m for m in DESIGN_METRICS if not {m, f"{m}_total", f"{m}_count"} & names]
    assert not missing

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert delta("pdserve:requests_total", status="ok") == 3
    assert delta("pdserve:prompt_tokens_total") == 3 * 40
    assert delta("pdserve:generation_tokens_total") == 3 * 6
    assert delta("pdserve:time_to_first_token_seconds_count") == 3
    assert delta("pdserve:e2e_request_latency_seconds_count") == 3
    assert delta("pdserve:request_queue_time_seconds_count") == 3
    assert delta("pdserve:inter_token_latency_seconds_count") == 3 * 5
    # one hand-off per request, counted on both ends: the first moves the prompt's 5 blocks of
    # the tiny Llama's KV, the others only their last (the decode worker caches the 4 before it)
    block_bytes = 2 * 2 * 8 * 2 * 16 * 4  # layers * (k, v) * block_size * kv_heads * dim * fp32
    for role in ("prefill", "decode"):
        assert delta("pdserve:kv_transfer_seconds_count", role=role) == 3
        assert delta("pdserve:kv_transfer_bytes_total", role=role) == (5 + 1 + 1) * block_bytes
    # the shared prefix hits the prefill worker's prefix cache (all but the last block)
    assert delta("pdserve:prefix_cache_hits_total", role="prefill") >= 2 * 32
    assert delta("pdserve:worker_generation_tokens_total") == 3 * 6
    # the prefill worker computes every prompt token the cache did not have; the decode
    # worker, which receives the KV, none
    computed = delta("pdserve:worker_prefill_tokens_total", role="prefill")
    assert computed + delta("pdserve:prefix_cache_hits_total", role="prefill") == 3 * 40
    assert delta("pdserve:worker_prefill_tokens_total", role="decode") == 0
    for reason in LOCAL_PREFILL_REASONS:  # exported, though this cluster prefills none locally
        assert ("pdserve:local_prefills_total", (("reason", reason),)) in after
        assert delta("pdserve:local_prefills_total", reason=reason) == 0
    # exported per worker, though this cluster does not speculate (no --speculative-config)
    for name in (
        "spec_decode_num_draft_attempts",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    ):
        for role in ("prefill", "decode"):
            assert any(n == f"pdserve:{name}_total" and ("role", role) in ls for n, ls in after)
        assert delta(f"pdserve:{name}_total") == 0


def test_label_values_are_bounded(http: httpx.Client, gateway_server: GatewayServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "user": "client-string-xyz"}
    assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    backend = gateway_server.gateway.backend
    workers = {s.worker_id for s in backend.worker_statuses()}
    slots = {r.slot for r in backend.worker_restarts()}
    assert slots  # one per worker the cluster started
    allowed = (
        workers
        | slots
        | {"prefill", "decode", "ttft", "tpot"}
        | set(LOCAL_PREFILL_REASONS)
        | {"ok", "invalid", "unauthorized", "rejected", "failed", "aborted"}
        | set(HOPS)  # first_token_hop_seconds{hop}
        | set(KV_TIERS)  # routed_prefix_hit_tokens_by_tier{tier}, prefix_cache_hits_by_tier
        | {"to_host", "to_device"}  # kv_offload_bytes{direction}
        | set(REFUSAL_REASONS)  # admission_refusals{reason}
        # model_info{model_name, quantization, kv_cache_dtype}: the server's own
        | {MODEL_NAME, "none", gateway_server.gateway.model.kv_cache_dtype}
    )
    for (_, labels), _ in _samples(http).items():
        for key, value in labels:
            if key not in ("le", "quantile"):
                assert value in allowed, (key, value)


def test_goodput_counts_only_requests_within_both_slos() -> None:
    """Goodput is in requests: one counts when every one of its prompts met both SLOs; each
    prompt's latencies are observed all the same."""
    metrics = GatewayMetrics(lambda: [], dict, list, SloTargets(ttft_s=0.5, tpot_s=0.05))

    def prompt(ttft: float, tpot: float, num_tokens: int = 5) -> FinishedGeneration:
        e2e = ttft + tpot * (num_tokens - 1)
        return FinishedGeneration(e2e, 0.0, ttft, tpot, 2, num_tokens)

    assert metrics.finished([prompt(0.2, 0.01)]) is True  # meets both
    assert metrics.finished([prompt(0.9, 0.01)]) is False  # TTFT too slow
    assert metrics.finished([prompt(0.2, 0.2)]) is False  # TPOT too slow
    # one token, exactly on the TTFT target
    assert metrics.finished([prompt(0.5, 0.0, num_tokens=1)]) is True
    assert metrics.finished([prompt(0.2, 0.01), prompt(0.2, 0.01)]) is True  # both prompts
    # one prompt's TPOT too slow
    assert metrics.finished([prompt(0.2, 0.3), prompt(0.2, 0.01)]) is False
    # no token: nothing to judge it by (and no goodput)
    no_token = FinishedGeneration(0.3, 0.0, None, None, 2, 0)
    assert metrics.finished([prompt(0.2, 0.01), no_token]) is None
    value = metrics.registry.get_sample_value
    assert value("pdserve:slo_met_total") == 3
    assert value("pdserve:time_per_output_token_seconds_count") == 9
    assert value("pdserve:time_per_output_token_seconds_sum") == pytest.approx(0.56)


def test_the_steps_time_over_the_latency_models_prediction_is_a_histogram_per_role() -> None:
    decode = StepRatios()
    for ratio in (0.6, 1.0, 1.0, 1.8):
        decode.count(ratio)
    metrics = GatewayMetrics(
        lambda: [], dict, list, SloTargets(), step_prediction_ratios=lambda: {"decode": decode}
    )
    value = metrics.registry.get_sample_value
    bucket = "pdserve:step_time_prediction_ratio_bucket"
    assert value(bucket, {"role": "decode", "le": "0.5"}) == 0
    assert value(bucket, {"role": "decode", "le": "0.67"}) == 1
    assert value(bucket, {"role": "decode", "le": "1.0"}) == 3
    assert value(bucket, {"role": "decode", "le": "2.0"}) == 4
    assert value(bucket, {"role": "decode", "le": "+Inf"}) == 4
    assert value("pdserve:step_time_prediction_ratio_count", {"role": "decode"}) == 4
    assert value("pdserve:step_time_prediction_ratio_sum", {"role": "decode"}) == 4.4


def test_worker_restarts_are_counted_per_slot() -> None:
    restarts = [SlotRestarts("decode-0", "decode", 2), SlotRestarts("prefill-0", "prefill", 0)]
    metrics = GatewayMetrics(lambda: [], dict, lambda: restarts, SloTargets())
    value = metrics.registry.get_sample_value
    assert value("pdserve:worker_restarts_total", {"role": "decode", "slot": "decode-0"}) == 2
    assert value("pdserve:worker_restarts_total", {"role": "prefill", "slot": "prefill-0"}) == 0


def test_speculative_decoding_counters_are_exported_per_worker() -> None:
    """vLLM's ``spec_decode_num_drafts`` / ``_draft_tokens`` / ``_accepted_tokens``, and the
    times sequences asked for drafts, labelled as the other worker counters: read from each
    live worker's latest load report."""

    def status(worker_id: str, role: str, alive: bool, **counters: int) -> WorkerStatus:
        load = WorkerLoad(worker_id, 0, 0, 0, 0.0, WorkerCounters(**counters))
        return WorkerStatus(worker_id, role, alive, load)

    statuses = [
        status(
            "decode-0",
            "decode",
            True,
            num_draft_attempts=25,
            num_drafts=10,
            num_draft_tokens=40,
            num_accepted_draft_tokens=12,
        ),
        status("decode-1", "decode", False, num_draft_tokens=9),  # out of rotation: not exported
        status("prefill-0", "prefill", True),
    ]
    metrics = GatewayMetrics(lambda: statuses, dict, list, SloTargets())
    value = metrics.registry.get_sample_value
    drafts, accepted = (
        "pdserve:spec_decode_num_draft_tokens",
        "pdserve:spec_decode_num_accepted_tokens",
    )
    decode_0 = {"role": "decode", "worker": "decode-0"}
    assert value(f"{drafts}_total", decode_0) == 40
    assert value(f"{accepted}_total", decode_0) == 12
    assert value("pdserve:spec_decode_num_drafts_total", decode_0) == 10
    assert value("pdserve:spec_decode_num_draft_attempts_total", decode_0) == 25
    assert value(f"{drafts}_total", {"role": "decode", "worker": "decode-1"}) is None
    prefill_0 = {"role": "prefill", "worker": "prefill-0"}
    assert value(f"{drafts}_total", prefill_0) == value(f"{accepted}_total", prefill_0) == 0
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert families[drafts].type == families[accepted].type == "counter"


def test_expert_tokens_and_layer_imbalance_are_exported_per_worker() -> None:
    """A mixture-of-experts worker's tokens per expert (a counter per expert) and each sparse
    layer's busiest-over-mean ratio (a gauge per layer); a dense worker exports neither."""
    moe = WorkerCounters(expert_tokens=(5, 0, 3), expert_layer_imbalance=((0, 1.5), (2, 2.25)))
    statuses = [
        WorkerStatus("decode-0", "decode", True, WorkerLoad("decode-0", 0, 0, 0, 0.0, moe)),
        WorkerStatus("prefill-0", "prefill", True, WorkerLoad("prefill-0", 0, 0, 0, 0.0)),
    ]
    metrics = GatewayMetrics(lambda: statuses, dict, list, SloTargets())
    value = metrics.registry.get_sample_value
    decode_0 = {"role": "decode", "worker": "decode-0"}
    tokens = "pdserve:moe_expert_tokens_total"
    assert [value(tokens, {**decode_0, "expert": str(e)}) for e in range(3)] == [5, 0, 3]
    imbalance = "pdserve:moe_layer_imbalance"
    assert value(imbalance, {**decode_0, "layer": "2"}) == 2.25
    assert value(imbalance, {**decode_0, "layer": "1"}) is None  # a dense layer
    prefill_0 = {"role": "prefill", "worker": "prefill-0", "expert": "0"}
    assert value(tokens, prefill_0) is None


def test_prefix_hits_by_tier_and_host_tier_bytes_are_exported_per_worker() -> None:
    counters = WorkerCounters(
        num_prefix_cache_hit_tokens=96,
        num_prefix_cache_host_hit_tokens=32,
        num_kv_offloaded_bytes=4096,
        num_kv_loaded_bytes=1024,
    )
    load = WorkerLoad("prefill-0", 0, 0, 0, 0.0, counters)
    metrics = GatewayMetrics(
        lambda: [WorkerStatus("prefill-0", "prefill", True, load)], dict, list, SloTargets()
    )
    value = metrics.registry.get_sample_value
    worker = {"role": "prefill", "worker": "prefill-0"}
    hits = "pdserve:prefix_cache_hits_by_tier_total"
    assert value(hits, {**worker, "tier": "device"}) == 64
    assert value(hits, {**worker, "tier": "host"}) == 32
    moved = "pdserve:kv_offload_bytes_total"
    assert value(moved, {**worker, "direction": "to_host"}) == 4096
    assert value(moved, {**worker, "direction": "to_device"}) == 1024


def test_a_workers_steps_and_their_busy_and_cpu_time_are_exported() -> None:
    counters = WorkerCounters(
        num_steps=40, step_seconds=2.5, step_thread_cpu_seconds=1.25, process_cpu_seconds=3.5
    )
    load = WorkerLoad("decode-0", 0, 0, 0, 0.0, counters)
    metrics = GatewayMetrics(
        lambda: [WorkerStatus("decode-0", "decode", True, load)], dict, list, SloTargets()
    )
    value = metrics.registry.get_sample_value
    worker = {"role": "decode", "worker": "decode-0"}
    assert value("pdserve:worker_steps_total", worker) == 40
    assert value("pdserve:worker_step_seconds_total", worker) == 2.5
    assert value("pdserve:worker_step_thread_cpu_seconds_total", worker) == 1.25
    assert value("pdserve:worker_process_cpu_seconds_total", worker) == 3.5
