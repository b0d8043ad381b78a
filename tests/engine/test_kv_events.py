"""KV events: the blocks a worker's prefix cache stores and removes, told in order, add up to what
it holds; the log answers a cursor with what came after it, or a snapshot."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from engine import GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.kv_cache.budget import KVBudget
from engine.kv_cache.kv_events import KVEventLog, KVEventRecorder
from engine.llm_engine import LLMEngine
from engine.messages import KVBlocksEvent, KVCursor
from engine.scheduler import SchedulerConfig

A, B, C = (bytes([n]) * 16 for n in (1, 2, 3))


def test_the_recorder_merges_runs_of_one_kind_tier_and_group_in_order() -> None:
    recorder = KVEventRecorder()
    recorder.stored("device", 0, A)
    recorder.stored("device", 0, B)
    recorder.stored("device", 1, A)
    recorder.removed("device", 0, A)
    recorder.stored("host", 0, A)
    assert recorder.take() == (
        KVBlocksEvent("stored", "device", 0, (A, B)),
        KVBlocksEvent("stored", "device", 1, (A,)),
        KVBlocksEvent("removed", "device", 0, (A,)),
        KVBlocksEvent("stored", "host", 0, (A,)),
    )
    assert recorder.take() == ()


def test_the_log_answers_a_cursor_with_the_batches_after_it() -> None:
    log = KVEventLog()
    log.append((KVBlocksEvent("stored", "device", 0, (A, B)),))
    log.append(())  # a step without events is no batch
    log.append((KVBlocksEvent("removed", "device", 0, (A,)),))
    first = log.since(KVCursor(""))  # a new asker: a snapshot
    assert first.snapshot is not None and first.batches == ()
    assert first.snapshot.blocks == (KVBlocksEvent("stored", "device", 0, (B,)),)
    assert first.cursor == KVCursor(log.log_id, 2)
    log.append((KVBlocksEvent("stored", "host", 0, (A,)),))
    second = log.since(first.cursor)
    assert second.snapshot is None
    assert [b.number for b in second.batches] == [3]
    assert log.since(second.cursor).batches == ()
    assert log.holdings() == {("device", 0): frozenset({B}), ("host", 0): frozenset({A})}


def test_a_cursor_the_log_cannot_continue_gets_a_snapshot() -> None:
    log = KVEventLog(max_batches=2)
    for block_hash in (A, B, C):
        log.append((KVBlocksEvent("stored", "device", 0, (block_hash,)),))
    assert log.since(KVCursor(log.log_id, 1)).snapshot is None  # batches 2 and 3 are kept
    assert log.since(KVCursor(log.log_id, 0)).snapshot is not None  # batch 1 was dropped
    assert log.since(KVCursor("another worker's log", 3)).snapshot is not None
    assert log.since(KVCursor(log.log_id, 7)).snapshot is not None  # ahead of the log
    snapshot = log.since(KVCursor("")).snapshot
    assert snapshot is not None and snapshot.number == 3
    assert snapshot.blocks == (KVBlocksEvent("stored", "device", 0, (A, B, C)),)


def _engine(model_dir: Path, num_blocks: int, *, record: bool = True) -> LLMEngine:
    return LLMEngine(
        LoadConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=4, budget=KVBudget(num_blocks=num_blocks)),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        record_kv_events=record,
    )


def _churn_prompts(rng: random.Random, num_prompts: int) -> list[list[int]]:
    """Prompts of a few shared system prompts (some shared further) and suffixes of their own."""
    systems = [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    prompts = []
    for _ in range(num_prompts):
        system = rng.choice(systems)
        prompts.append(system + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 14))])
    return prompts


def test_events_add_up_to_the_cache_after_churn(llama_dir: Path) -> None:
    """Hundreds of requests with shared prefixes through a cache small enough to evict all the
    time, abort among them: after every step the log's holdings equal the cache's hashes."""
    engine = _engine(llama_dir, num_blocks=24)
    log = KVEventLog()
    rng = random.Random(7)
    prompts = _churn_prompts(rng, 300)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    num_evicting_steps = 0
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params, cache_salt=rng.choice([None, "tenant-b"]))
        if index % 17 == 3:
            engine.abort_request(f"r{index - 1}")
        while engine.has_unfinished_requests() and (index % 4 != 0 or rng.random() < 0.7):
            engine.step()
            events = engine.take_kv_events()
            num_evicting_steps += any(e.kind == "removed" for e in events)
            log.append(events)
            assert log.holdings() == engine.block_manager.cached_block_hashes()
    while engine.has_unfinished_requests():
        engine.step()
        log.append(engine.take_kv_events())
    assert log.holdings() == engine.block_manager.cached_block_hashes()
    assert num_evicting_steps > 20  # the cache churned: the check saw evictions


def test_an_engine_records_no_events_unless_asked(llama_dir: Path) -> None:
    engine = _engine(llama_dir, num_blocks=24, record=False)
    engine.add_request("r", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.records_kv_events and engine.take_kv_events() == ()
    assert engine.block_manager.cached_block_hashes()  # (it caches all the same)


def test_a_load_report_carries_the_events_after_the_cursor(llama_dir: Path) -> None:
    loop = EngineLoop(_engine(llama_dir, num_blocks=64), "worker-0")
    loop.start()
    try:
        assert loop.load().kv_events is None  # asked without a cursor
        params = SamplingParams(temperature=0.0, max_tokens=3)
        loop.submit(GenerateRequest("r0", list(range(3, 20)), params, "gw"))
        _wait_until_idle(loop)
        first = loop.load(kv_cursor=KVCursor("")).kv_events
        assert first is not None and first.snapshot is not None
        assert ("device", 0) in loop.engine.block_manager.cached_block_hashes()
        assert {e.block_hashes for e in first.snapshot.blocks} == {
            tuple(sorted(loop.engine.block_manager.cached_block_hashes()[("device", 0)]))
        }
        loop.submit(GenerateRequest("r1", list(range(30, 50)), params, "gw"))
        _wait_until_idle(loop)
        second = loop.load(kv_cursor=first.cursor).kv_events
        assert second is not None and second.snapshot is None and second.batches
        assert all(e.kind == "stored" for b in second.batches for e in b.events)
    finally:
        loop.stop()


def _wait_until_idle(loop: EngineLoop) -> None:
    deadline = time.monotonic() + 60
    while loop.call(lambda engine: engine.has_unfinished_requests()):
        if time.monotonic() > deadline:
            pytest.fail("the engine did not finish its requests within 60 s")
        loop.next_batch("gw", 0.05)
    loop.call(lambda engine: None)  # (a turn under the lock logs the last step's events)
