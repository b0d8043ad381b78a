"""EngineLoop: requests submitted while the engine is busy get in at the next step boundary."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from engine import LLM, GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.kv_cache.budget import KVBudget
from engine.llm_engine import LLMEngine
from engine.model_runner import LaunchedStep, SampledStep
from engine.scheduler import SchedulerConfig

GATEWAY = "gw"


def _busy_loop(model_dir: Path) -> EngineLoop:
    """A started loop stepping a long request (400 tokens at 64 tokens a step)."""
    engine = LLMEngine(
        LoadConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=8, budget=KVBudget(num_blocks=256)),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64),
    )
    loop = EngineLoop(engine, "worker-0")
    loop.start()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    loop.submit(GenerateRequest("busy", list(range(3, 40)), long, GATEWAY))
    deadline = time.monotonic() + 30
    while engine.stats.num_steps < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    return loop


def test_concurrent_submissions_wait_for_at_most_the_step_in_progress(llama_dir: Path) -> None:
    """Several threads submit while the loop steps back to back and a gateway drains outputs,
    as in a worker actor. With a plain lock the loop took it back after each step before the
    waiting threads woke: submissions waited up to 85 steps here."""
    loop = _busy_loop(llama_dir)
    steps_waited: list[int] = []
    draining = threading.Event()

    def submit_several(thread_index: int) -> None:
        short = SamplingParams(temperature=0.0, max_tokens=1)
        for i in range(10):
            before = loop.engine.stats.num_steps
            request = GenerateRequest(f"r{thread_index}-{i}", [5 + i, 6, 7], short, GATEWAY)
            loop.submit(request)
            steps_waited.append(loop.engine.stats.num_steps - before)

    def drain() -> None:
        while draining.is_set():
            loop.next_batch(GATEWAY, 0.05)

    draining.set()
    drainer = threading.Thread(target=drain)
    submitters = [threading.Thread(target=submit_several, args=(k,)) for k in range(6)]
    try:
        for thread in [drainer, *submitters]:
            thread.start()
        for thread in submitters:
            thread.join(timeout=60)
        assert loop.engine.has_request("busy")  # the loop was busy throughout
    finally:
        draining.clear()
        drainer.join(timeout=5)
        loop.stop()
    assert len(steps_waited) == 60
    assert max(steps_waited) <= 1, sorted(steps_waited)


def test_a_structured_output_grammar_compiles_while_the_engine_steps_on(llama_dir: Path) -> None:
    """A new schema is compiled before submit takes the loop's lock (it can take ~100 ms):
    the busy request keeps stepping meanwhile. Before, it compiled under the lock."""
    from engine.structured.spec import StructuredOutputSpec

    loop = _busy_loop(llama_dir)
    compile_grammar = loop.engine.grammars
    steps_while_compiling: list[int] = []

    def slow_compile(spec: StructuredOutputSpec) -> object:
        if steps_while_compiling:  # compiled: the add's own call finds it in the cache
            return compile_grammar(spec)
        before = loop.engine.stats.num_steps
        deadline = time.monotonic() + 10
        while loop.engine.stats.num_steps < before + 3 and time.monotonic() < deadline:
            time.sleep(0.001)  # the engine must step on meanwhile
        steps_while_compiling.append(loop.engine.stats.num_steps - before)
        return compile_grammar(spec)

    loop.engine.grammars = slow_compile  # type: ignore[method-assign]
    spec = StructuredOutputSpec(choice=("yes", "no"))
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec)
    try:
        assert loop.submit(GenerateRequest("constrained", [5, 6, 7], params, GATEWAY))
    finally:
        loop.stop()
    assert len(steps_while_compiling) == 1 and steps_while_compiling[0] >= 3


def test_an_async_scheduling_loop_streams_each_request_the_tokens_of_stepping_in_turn(
    llama_dir: Path,
) -> None:
    """Requests arrive on another thread while the loop steps ahead of its results; every
    token is published once, in order, as the engine stepping in turn gives them."""
    engine = LLMEngine(
        LoadConfig(str(llama_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=8, budget=KVBudget(num_blocks=256)),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, async_scheduling=True),
    )
    prompts = {f"r{i}": [3 + i, 7, 11 + 2 * i, 5][: 1 + i % 4] * (2 + i) for i in range(6)}
    params = {
        request_id: SamplingParams(temperature=0.0, max_tokens=3 + 5 * i, ignore_eos=True)
        for i, request_id in enumerate(prompts)
    }
    in_turn = LLM(str(llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=32)
    expected = {
        request_id: output.outputs[0].token_ids
        for request_id, output in zip(
            prompts, in_turn.generate(list(prompts.values()), list(params.values())), strict=True
        )
    }
    loop = EngineLoop(engine, "worker-0")
    loop.start()
    streamed: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    finished: dict[str, str] = {}
    try:
        for request_id, prompt in prompts.items():
            loop.submit(GenerateRequest(request_id, prompt, params[request_id], GATEWAY))
            time.sleep(0.002)  # arrivals spread over the loop's steps
        deadline = time.monotonic() + 60
        while len(finished) < len(prompts) and time.monotonic() < deadline:
            batch = loop.next_batch(GATEWAY, 0.05)
            for event in [] if batch is None else batch.events:
                assert event.position == len(streamed[event.request_id])
                streamed[event.request_id].append(event.token_id)
                if event.finish_reason is not None:
                    finished[event.request_id] = event.finish_reason
    finally:
        loop.stop()
    assert streamed == expected
    assert finished == dict.fromkeys(prompts, "length")
    assert engine.stats.num_steps > max(p.max_tokens for p in params.values())


def _stream_until_done(
    loop: EngineLoop, request_ids: set[str], timeout_s: float = 60
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Each request's streamed tokens, and the failure message of those that failed."""
    tokens: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    failed: dict[str, str] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while done != request_ids and time.monotonic() < deadline:
        batch = loop.next_batch(GATEWAY, 0.05)
        if batch is None:
            continue
        for event in batch.events:
            tokens[event.request_id].append(event.token_id)
            if event.finish_reason is not None:
                done.add(event.request_id)
        for failure in batch.failures:
            failed[failure.request_id] = failure.message
            done.add(failure.request_id)
    assert done == request_ids, f"still running: {request_ids - done}"
    return tokens, failed


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "async"])
def test_after_a_failed_step_the_loop_serves_new_requests_exactly(
    llama_dir: Path, async_scheduling: bool
) -> None:
    """A step that raises fails the requests in flight, not the worker: with async
    scheduling the step launched ahead goes with them, and requests sent afterwards get the
    tokens they would have got from a fresh engine, with every block given back."""
    engine = LLMEngine(
        LoadConfig(str(llama_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=8, budget=KVBudget(num_blocks=128)),
        SchedulerConfig(max_num_seqs=8, async_scheduling=async_scheduling),
    )
    sample = engine.runner.sample
    calls = itertools.count()

    def sample_failing_once(step: LaunchedStep) -> SampledStep:
        if next(calls) == 3:
            raise RuntimeError("injected fault")
        return sample(step)

    engine.runner.sample = sample_failing_once  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {f"first-{i}": [5 + i, 9, 13, 2 + i] * (1 + i) for i in range(3)}
    later = {f"later-{i}": [7, 3 + i, 11] * (2 + i) for i in range(2)}
    loop = EngineLoop(engine, "worker-0")
    loop.start()
    try:
        for request_id, prompt in prompts.items():
            loop.submit(GenerateRequest(request_id, prompt, params, GATEWAY))
        _, failed = _stream_until_done(loop, set(prompts))
        assert failed == dict.fromkeys(prompts, "internal error in the engine step")
        for request_id, prompt in later.items():
            loop.submit(GenerateRequest(request_id, prompt, params, GATEWAY))
        tokens, failed = _stream_until_done(loop, set(later))
    finally:
        loop.stop()
    assert failed == {}
    fresh = LLM(str(llama_dir), dtype="float32", device="cpu")
    expected = [o.outputs[0].token_ids for o in fresh.generate(list(later.values()), params)]
    assert [tokens[request_id] for request_id in later] == expected
    assert engine.block_manager.usage == 0.0 and not engine.has_unfinished_requests()
