"""Step timings: what each engine step computed and how long it took, in the worker's load
report once (the router's latency model is fitted from them), a loop's step taking its turn's
time, and the start-up profile's steps, on the engine and through a worker's loop.
"""

from __future__ import annotations

from pathlib import Path

from engine import GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.kv_cache.budget import KVBudget
from engine.latency_profile import run_latency_profile_in_loop
from engine.llm_engine import LLMEngine
from engine.messages import StepTiming
from engine.scheduler import SchedulerConfig
from engine.step_timings import StepTimingLog


def _engine(model_dir: Path, budget: int = 16, num_blocks: int = 128) -> LLMEngine:
    return LLMEngine(
        LoadConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=8, budget=KVBudget(num_blocks=num_blocks)),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
    )


def test_each_step_records_its_prompt_chunks_decode_rows_and_their_context(
    llama_dir: Path,
) -> None:
    """A 20-token prompt at 16 tokens a step: a chunk of 16 (attending 1 + ... + 16 keys), then
    the last 4 with the first token (16 + 1 ... 16 + 4), then one decode row per step reading
    the 21, 22 ... positions before and at it."""
    engine = _engine(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("r", list(range(3, 23)), params)
    while engine.has_unfinished_requests():
        engine.step()
    timings = engine.step_timings.take()
    shapes = [
        (
            t.num_prefill_tokens,
            t.prefill_attention_tokens,
            t.num_decode_tokens,
            t.decode_context_tokens,
        )
        for t in timings
    ]
    assert shapes == [
        (16, 16 * 17 // 2, 0, 0),
        (4, 4 * 16 + 4 * 5 // 2, 0, 0),
        (0, 0, 1, 21),
        (0, 0, 1, 22),
    ]
    assert all(t.seconds > 0 for t in timings)
    assert engine.step_timings.take() == ()  # taken once


def test_the_engine_counts_its_steps_their_wall_time_and_its_threads_cpu_time(
    llama_dir: Path,
) -> None:
    """The worker's totals (exported as ``pdserve:worker_step*``): the steps that ran the model,
    their wall time as the timings have it, and the engine thread's CPU time in them, which a
    busy thread spends on them (within the wall time: nothing else runs on its behalf)."""
    engine = _engine(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("r", list(range(3, 23)), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # nothing to run: not a step
    counters = engine.counters()
    timings = engine.step_timings.take()
    assert counters.num_steps == len(timings) == 4
    assert abs(counters.step_seconds - sum(t.seconds for t in timings)) < 1e-9
    assert 0 < counters.step_thread_cpu_seconds <= counters.step_seconds + 0.01


def test_a_load_report_carries_the_steps_since_the_one_before(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    loop = EngineLoop(engine, "worker-0")
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        loop.submit(GenerateRequest("r", list(range(3, 12)), params, "gw"))
        events = 0
        while events < 4:  # every token out: every step done
            batch = loop.next_batch("gw", 30)
            assert batch is not None
            events += len(batch.events)
        first = loop.load()
        assert [t.num_decode_tokens for t in first.step_timings] == [0, 1, 1, 1]
        # the report carries the process's CPU time as it is when taken: its steps' and more
        again = loop.load()
        assert again.step_timings == ()
        steps_cpu_s = first.counters.step_thread_cpu_seconds
        assert 0 < steps_cpu_s < first.counters.process_cpu_seconds
        assert first.counters.process_cpu_seconds <= again.counters.process_cpu_seconds
    finally:
        loop.stop()


def test_in_a_loop_a_step_takes_its_turns_time_and_a_step_outside_a_turn_keeps_its_own() -> None:
    log = StepTimingLog()
    log.hold_for_turns = True
    log.record(StepTiming(8, 36, 0, 0, 0.002))
    assert log.take() == ()  # held until its turn ends
    log.end_turn(0.005)  # the step, then its outputs: 5 ms in all
    log.record(StepTiming(0, 0, 1, 9, 0.001))  # run under ``call`` (no turn ends it) ...
    log.record(StepTiming(0, 0, 1, 10, 0.001))  # ... kept as it was once the next one comes
    log.end_turn(0.0005)  # a turn shorter than the step's own time cannot shorten it
    assert [t.seconds for t in log.take()] == [0.005, 0.001, 0.001]


def test_the_profile_runs_through_a_workers_loop_prompt_sizes_and_decode_batches(
    llama_dir: Path,
) -> None:
    engine = _engine(llama_dir, budget=64, num_blocks=256)
    loop = EngineLoop(engine, "worker-0")
    loop.start()
    try:
        steps = run_latency_profile_in_loop(loop)
        assert steps > 0 and not engine.has_unfinished_requests()
        timings = loop.load().step_timings
        assert len(timings) == steps  # each turn ended before its outputs went out
    finally:
        loop.stop()
    prompt_sizes = {t.num_prefill_tokens for t in timings if t.num_decode_tokens == 0}
    assert {8, 16, 32, 64} <= prompt_sizes
    decode_batches = {t.num_decode_tokens for t in timings if t.num_prefill_tokens == 0}
    assert {1, 4, 8} <= decode_batches  # (16 sequences held to max_num_seqs 8)
    assert engine.block_manager.usage == 0  # every profile request ended, its blocks freed
