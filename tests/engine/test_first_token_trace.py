"""EngineLoop: a request's first token leaves with its worker stamps (``FirstTokenTrace``), in the
order it passed them; no other token carries a trace, and every batch the stream sends is
stamped with the time it was taken off the queue."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import GenerateRequest, SamplingParams, TokenEvent
from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.kv_cache.budget import KVBudget
from engine.llm_engine import LLMEngine
from engine.messages import OutputBatch
from engine.scheduler import SchedulerConfig

GATEWAY = "gw"


@pytest.fixture
def loop(llama_dir: Path) -> Iterator[EngineLoop]:
    """A started loop whose steps take at most 16 prompt tokens (a longer prompt is chunked)."""
    engine = LLMEngine(
        LoadConfig(str(llama_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=8, budget=KVBudget(num_blocks=256)),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
    )
    loop = EngineLoop(engine, "worker-0")
    loop.start()
    yield loop
    loop.stop()


def _until_finished(
    stream: Iterator[OutputBatch], num_requests: int
) -> list[tuple[OutputBatch, TokenEvent]]:
    """(batch, event) for every event the stream sends until ``num_requests`` samples end."""
    received = []
    num_finished = 0
    while num_finished < num_requests:
        batch = next(stream)
        for event in batch.events:
            received.append((batch, event))
            num_finished += event.finish_reason is not None
    return received


def test_a_first_token_carries_its_worker_stamps_in_path_order(loop: EngineLoop) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    stream = loop.stream(GATEWAY)
    before = time.time()
    assert loop.submit(GenerateRequest("r1", [5, 6, 7, 8], params, GATEWAY))
    received = _until_finished(stream, 1)
    after = time.time()

    (first_batch, first), *rest = received
    trace = first.first_token_trace
    assert trace is not None and first.position == 0
    assert trace.worker_id == "worker-0"
    path = [
        before,
        trace.received_at,
        trace.queued_at,
        trace.step_started_at,
        trace.step_ended_at,
        trace.emitted_at,
        first_batch.streamed_at,
        after,
    ]
    assert path == sorted(path), path
    # a prompt of one step: scheduled in the step that sampled its first token
    assert trace.step_started_at <= trace.scheduled_at <= trace.step_ended_at
    assert [event.first_token_trace for _, event in rest] == [None, None]
    assert all(batch.streamed_at is not None for batch, _ in rest)


def test_the_worker_says_when_it_received_the_request(loop: EngineLoop) -> None:
    """A worker's submit call passes the time it began: the wait for its own locks before the
    engine's counts in the worker's hops."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    stream = loop.stream(GATEWAY)
    received_at = time.time() - 0.5
    assert loop.submit(GenerateRequest("r1", [5, 6, 7], params, GATEWAY), received_at=received_at)
    [(_, first)] = _until_finished(stream, 1)
    assert first.first_token_trace is not None
    assert first.first_token_trace.received_at == received_at


def test_a_chunked_prompt_is_scheduled_before_the_step_of_its_first_token(
    loop: EngineLoop,
) -> None:
    """40 prompt tokens at 16 a step: three steps; the first schedules it, the third samples."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    stream = loop.stream(GATEWAY)
    assert loop.submit(GenerateRequest("long", list(range(3, 43)), params, GATEWAY))
    [(_, first)] = _until_finished(stream, 1)
    trace = first.first_token_trace
    assert trace is not None
    assert trace.queued_at <= trace.scheduled_at < trace.step_started_at < trace.step_ended_at


def test_only_sample_0_of_each_request_carries_a_trace(loop: EngineLoop) -> None:
    """n = 2: both samples' first tokens leave together; the request's trace rides on sample
    0's. A second request's first token has its own."""
    params = SamplingParams(temperature=0.8, max_tokens=2, n=2, seed=1, ignore_eos=True)
    stream = loop.stream(GATEWAY)
    assert loop.submit(GenerateRequest("a", [5, 6, 7], params, GATEWAY))
    assert loop.submit(GenerateRequest("b", [8, 9, 10], params, GATEWAY))
    received = _until_finished(stream, 4)
    traced = {
        (event.request_id, event.sample_index, event.position)
        for _, event in received
        if event.first_token_trace is not None
    }
    assert traced == {("a", 0, 0), ("b", 0, 0)}


def test_a_request_resumed_after_its_first_token_has_no_trace(loop: EngineLoop) -> None:
    """Its first token reached the client from the worker that ran it before; this worker
    continues after it, and sends nothing to trace."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    stream = loop.stream(GATEWAY)
    resumed = GenerateRequest("r1#1", [5, 6, 7], params, GATEWAY, resume_token_ids={0: [11]})
    assert loop.submit(resumed)
    received = _until_finished(stream, 1)
    assert [event.position for _, event in received] == [1, 2]
    assert all(event.first_token_trace is None for _, event in received)
