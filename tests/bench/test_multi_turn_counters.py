"""The server's counters read from /metrics: pdserve's page as its gateway renders it, vLLM's in
its exposition format (three generations of its prompt-token counters), the change over a run,
and a reading that waits until the counters stop moving."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from bench.serving.server_metrics import (
    ServerCounters,
    counters_from_text,
    metrics_url,
    settled_counters,
)
from engine.messages import WorkerCounters, WorkerLoad
from router.cluster import WorkerStatus
from router.gateway.metrics import GatewayMetrics, SloTargets
from router.gateway.text_stream import FinishedGeneration


def _pdserve_page(prompt_tokens: int, workers: dict[str, tuple[int, int, int]]) -> str:
    """pdserve's /metrics after prompts of ``prompt_tokens`` tokens finished, with each worker
    (id -> prefill tokens computed, prefix-cache tokens queried, hit)."""
    statuses = [
        WorkerStatus(
            worker_id,
            worker_id.split("-")[0],
            True,
            WorkerLoad(
                worker_id,
                0,
                0,
                0,
                0.1,
                WorkerCounters(
                    num_prefill_tokens=computed,
                    num_prefix_cache_queried_tokens=queried,
                    num_prefix_cache_hit_tokens=hit,
                ),
            ),
        )
        for worker_id, (computed, queried, hit) in workers.items()
    ]
    statuses.append(WorkerStatus("decode-9", "decode", False, None))  # down: not exported
    metrics = GatewayMetrics(lambda: statuses, dict, list, SloTargets())
    if prompt_tokens:
        metrics.finished([FinishedGeneration(1.0, 0.0, 0.1, 0.01, prompt_tokens, 5)])
    return metrics.render().decode()


def test_pdserve_counters_sum_over_workers() -> None:
    page = _pdserve_page(
        3000, {"prefill-0": (900, 2000, 1600), "prefill-1": (700, 800, 480), "decode-0": (16, 0, 0)}
    )
    assert "pdserve:worker_prefill_tokens_total{" in page  # the real exporter's names
    counters = counters_from_text(page)
    assert counters is not None and counters.server == "pdserve"
    assert counters.prompt_tokens == 3000
    assert counters.prefill_tokens_computed == 900 + 700 + 16
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (2800, 2080)
    assert counters.prefix_hit_rate == pytest.approx(2080 / 3000)
    assert counters.totals["pdserve:prompt_tokens_total"] == 3000
    # and over the workers of each role
    computed = "pdserve:worker_prefill_tokens_total"
    assert counters.role_totals[computed, "prefill"] == 900 + 700
    assert counters.role_totals[computed, "decode"] == 16


def test_the_change_over_a_run_is_after_minus_before() -> None:
    before = counters_from_text(_pdserve_page(1000, {"prefill-0": (1000, 0, 0)}))
    after = counters_from_text(_pdserve_page(5000, {"prefill-0": (2200, 3900, 2800)}))
    assert before is not None and after is not None
    change = after.since(before)
    assert change.prompt_tokens == 4000 and change.prefill_tokens_computed == 1200
    assert change.prefix_cache_hits == 2800
    assert change.prefix_hit_rate == pytest.approx(0.7)
    assert change.totals["pdserve:prompt_tokens_total"] == 4000
    assert change.role_totals["pdserve:worker_prefill_tokens_total", "prefill"] == 1200


def test_a_pdserve_page_before_any_worker_reported_has_no_worker_counters() -> None:
    counters = counters_from_text(_pdserve_page(0, {}))
    assert counters is not None and counters.prompt_tokens == 0
    assert counters.prefill_tokens_computed is None and counters.prefix_cache_hits is None
    assert counters.prefix_hit_rate is None
    later = counters_from_text(_pdserve_page(500, {"prefill-0": (400, 96, 96)}))
    assert later is not None
    change = later.since(counters)
    assert change.prompt_tokens == 500 and change.prefill_tokens_computed is None


VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="pdserve-demo"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="pdserve-demo"} 12000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="pdserve-demo"} 9000.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="pdserve-demo"} 12000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="pdserve-demo"} 4500.0
"""
VLLM_CACHED = """\
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens.
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="pdserve-demo"} 9100.0
"""
VLLM_BY_SOURCE = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="pdserve-demo",source="local_compute"} 2950.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="pdserve-demo",source="local_cache_hit"} 9050.0
"""


@pytest.mark.parametrize(
    ("extra", "computed"), [("", 3000.0), (VLLM_CACHED, 2900.0), (VLLM_BY_SOURCE, 2950.0)]
)
def test_vllm_computed_tokens_come_from_its_most_direct_counter(
    extra: str, computed: float
) -> None:
    counters = counters_from_text(VLLM_PAGE + extra)
    assert counters is not None and counters.server == "vllm"
    assert counters.prompt_tokens == 12000 and counters.prefix_cache_hits == 9000
    assert counters.prefill_tokens_computed == computed
    assert counters.prefix_hit_rate == pytest.approx(0.75)


def test_other_pages_are_no_servers_and_the_url_is_beside_v1() -> None:
    page = "# TYPE http_requests_total counter\nhttp_requests_total 3.0\n"
    assert counters_from_text(page) is None
    assert metrics_url("http://127.0.0.1:8400/v1") == "http://127.0.0.1:8400/metrics"
    assert metrics_url("http://127.0.0.1:8400/v1/") == "http://127.0.0.1:8400/metrics"
    assert metrics_url("http://h:1") == "http://h:1/metrics"


def test_a_settled_reading_waits_until_two_reads_agree() -> None:
    """The workers' counters reach pdserve's page a load poll late: 100, then 150, then 150."""
    pages = itertools.chain(
        [_pdserve_page(10, {"prefill-0": (100, 0, 0)})],
        itertools.repeat(_pdserve_page(10, {"prefill-0": (150, 0, 0)})),
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text=next(pages))

    async def go() -> ServerCounters | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            url = "http://server/metrics"
            return await settled_counters(client, url, {"Authorization": "Bearer k"}, 0.0)

    counters = asyncio.run(go())
    assert counters is not None and counters.prefill_tokens_computed == 150
    assert len(seen) == 3 and seen[0].headers["authorization"] == "Bearer k"


def test_an_unreadable_page_gives_no_counters() -> None:
    async def go(status: int) -> ServerCounters | None:
        transport = httpx.MockTransport(lambda _: httpx.Response(status, text="nope"))
        async with httpx.AsyncClient(transport=transport) as client:
            return await settled_counters(client, "http://server/metrics", {}, 0.0)

    assert asyncio.run(go(404)) is None
    assert asyncio.run(go(200)) is None  # not a Prometheus page of either server
