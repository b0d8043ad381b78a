"""Running a benchmark: build the workload, warm up, send on schedule, summarize.

A run passes through: workload built (seeded) -> warm-up requests (not timed; any failure
stops the run, as a wrong model name or key would fail every request) -> the server's counters
read, if asked (``server_metrics``) -> timed requests sent at their arrival offsets, each
waiting for a ``max_concurrency`` slot if there is a bound (TTFT and e2e count from the actual
send, so client-side queueing is not in them) -> the counters read again, their change kept ->
records summarized. A multi-turn workload runs as conversations (``conversation_runner``): the
request rate is then the conversations' arrival rate. A sweep runs the workload's distribution
at each request rate in turn, each rate with its own prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

import httpx

from bench.serving.arrivals import ArrivalSpec, send_offsets
from bench.serving.client import EndpointConfig, stream_request
from bench.serving.conversation_runner import (
    ReplyIdsSource,
    WarmUpError,
    reply_ids_source,
    send_conversations,
    warm_up_conversations,
)
from bench.serving.conversations import build_conversations
from bench.serving.metrics import DEFAULT_PERCENTILES, SLO, RequestRecord, Summary, summarize
from bench.serving.progress import Progress
from bench.serving.server_metrics import ServerCounters, metrics_url, settled_counters
from bench.serving.tokens import TokenCodec
from bench.serving.workloads import BenchRequest, WorkloadSpec, build_requests

_WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from the timed ones (no cache hits)
_SWEEP_SEED_STRIDE = 7_919  # each rate of a sweep gets its own prompts


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (e.g. the warm-up request failed)."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    endpoint: EndpointConfig  # where to send and how (model, key, API, sampling)
    tokenizer_dir: str  # Hugging Face tokenizer directory of the served model
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)  # prompt / output lengths
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)  # request rate, concurrency
    slo: SLO = field(default_factory=SLO)  # goodput's latency bounds
    num_prompts: int = 100  # timed requests per run (multi-turn: the workload's turns instead)
    seed: int = 0  # seeds the workload and the arrival times
    num_warmups: int = 1  # untimed requests sent one by one before the run (multi-turn: >= 1)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES  # latency percentiles to report
    progress: bool = True  # draw a progress bar on stderr
    server_counters: bool = False  # read the server's /metrics before and after the run


@dataclass(frozen=True, slots=True)
class BenchResult:
    config: BenchConfig  # the settings of this run (its own request rate)
    summary: Summary  # aggregates over the records
    records: tuple[RequestRecord, ...]  # one per timed request, in workload order
    started_at: str  # UTC ISO-8601 time the timed requests started
    # the change of the server's counters over the timed requests; None: not asked for, or
    # the server's /metrics could not be read
    server_counters: ServerCounters | None = None
    # multi-turn: where the replies' token ids came from ("tokenizer": re-encoded text, so a
    # next prompt may not extend the conversation exactly); None for other workloads
    reply_token_ids: ReplyIdsSource | None = None


@dataclass(frozen=True, slots=True)
class SweepResult:
    request_rates: tuple[float, ...]  # the rates run, in order
    runs: tuple[BenchResult, ...]  # one result per rate


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run one benchmark to completion (starts its own event loop)."""
    return asyncio.run(run_benchmark_async(config))


def sweep(config: BenchConfig, request_rates: Sequence[float]) -> SweepResult:
    """Run ``config`` once per request rate: the same workload distribution, but each rate its
    own prompts (seed ``config.seed + i * _SWEEP_SEED_STRIDE``), so a server's prefix cache
    cannot serve a later rate's prompts from an earlier rate's."""
    return asyncio.run(sweep_async(config, request_rates))


async def run_benchmark_async(config: BenchConfig, codec: TokenCodec | None = None) -> BenchResult:
    codec = codec or load_codec(config.tokenizer_dir)
    return await _run(config, codec)


async def sweep_async(config: BenchConfig, request_rates: Sequence[float]) -> SweepResult:
    codec = load_codec(config.tokenizer_dir)
    runs = []
    for index, rate in enumerate(request_rates):
        run_config = replace(
            config,
            arrivals=replace(config.arrivals, request_rate=rate),
            seed=config.seed + index * _SWEEP_SEED_STRIDE,
        )
        runs.append(await _run(run_config, codec, label=f"rate {rate:g} "))
    return SweepResult(tuple(request_rates), tuple(runs))


def load_codec(tokenizer_dir: str) -> TokenCodec:
    try:
        return TokenCodec.load(tokenizer_dir)
    except (OSError, ValueError) as error:
        raise BenchmarkError(f"cannot load a tokenizer from {tokenizer_dir!r}: {error}") from error


async def _run(config: BenchConfig, codec: TokenCodec, label: str = "") -> BenchResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(config.endpoint.timeout_s), limits=limits
    ) as client:
        if config.workload.kind == "multi-turn":
            return await _run_conversations(client, config, codec, label)
        requests = build_requests(config.workload, codec, config.num_prompts, config.seed)
        await _warm_up(client, config, codec)
        before = await _counters(client, config)
        started_at = datetime.now(timezone.utc).isoformat()
        records, duration_s = await _send_all(client, config, codec, requests, label)
        counters = await _counters_since(client, config, before)
    summary = summarize(records, duration_s, config.slo, config.percentiles)
    return BenchResult(config, summary, tuple(records), started_at, counters)


async def _run_conversations(
    client: httpx.AsyncClient, config: BenchConfig, codec: TokenCodec, label: str
) -> BenchResult:
    conversations = build_conversations(config.workload, codec, config.seed)
    warm_up_seed = config.seed + _WARMUP_SEED_OFFSET
    try:
        endpoint = await warm_up_conversations(
            client, config.endpoint, codec, config.workload, config.num_warmups, warm_up_seed
        )
    except WarmUpError as error:
        raise BenchmarkError(str(error)) from error
    before = await _counters(client, config)
    started_at = datetime.now(timezone.utc).isoformat()
    num_turns = len(conversations) * config.workload.num_turns
    progress = Progress(num_turns, label, config.progress)
    records, duration_s = await send_conversations(
        client, endpoint, codec, conversations, config.arrivals, config.seed, progress
    )
    counters = await _counters_since(client, config, before)
    summary = summarize(records, duration_s, config.slo, config.percentiles)
    return BenchResult(
        config, summary, tuple(records), started_at, counters, reply_ids_source(endpoint)
    )


async def _counters(client: httpx.AsyncClient, config: BenchConfig) -> ServerCounters | None:
    if not config.server_counters:
        return None
    url = metrics_url(config.endpoint.base_url)
    counters = await settled_counters(client, url, config.endpoint.headers())
    if counters is None:
        print(f"bench.serve: cannot read a pdserve or vLLM {url}", file=sys.stderr)
    return counters


async def _counters_since(
    client: httpx.AsyncClient, config: BenchConfig, before: ServerCounters | None
) -> ServerCounters | None:
    """The change of the server's counters since ``before``; None if either read failed."""
    if before is None:
        return None
    after = await _counters(client, config)
    return after.since(before) if after is not None else None


async def _warm_up(client: httpx.AsyncClient, config: BenchConfig, codec: TokenCodec) -> None:
    if config.num_warmups < 1:
        return
    seed = config.seed + _WARMUP_SEED_OFFSET
    for request in build_requests(config.workload, codec, config.num_warmups, seed):
        origin = time.perf_counter()
        record = await stream_request(client, config.endpoint, request, codec.count, origin)
        if not record.success:
            raise BenchmarkError(f"warm-up request to {config.endpoint.url} failed: {record.error}")


async def _send_all(
    client: httpx.AsyncClient,
    config: BenchConfig,
    codec: TokenCodec,
    requests: list[BenchRequest],
    label: str,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its offset; the records and the seconds until the last ended."""
    offsets = send_offsets(config.arrivals, len(requests), config.seed)
    bound = config.arrivals.max_concurrency
    slots = asyncio.Semaphore(bound) if bound is not None else None
    progress = Progress(len(requests), label, config.progress)
    origin = time.perf_counter()

    async def send(request: BenchRequest) -> RequestRecord:
        async with slots if slots is not None else contextlib.nullcontext():
            record = await stream_request(client, config.endpoint, request, codec.count, origin)
        progress.advance(record.success)
        return record

    tasks = []
    for request, offset in zip(requests, offsets):
        delay = origin + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(request)))
    records = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - origin
    progress.close()
    return list(records), duration_s
