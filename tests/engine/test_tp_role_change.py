"""A tensor-parallel worker's engine rebuilt in place for its next role (what a worker that
changes role does, router/worker_host.py): rank 0 keeps its weights and its ranks' group, and
its followers, running still in their own processes, rebuild on their own shards as it does
(``RebuildCommand``); the KV cache is kept where the new configs give it the same shape. Every
engine along the way decodes exactly what the engine of one rank does, and the new engine's
close stops the followers the first one started."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kv_cache.budget import KVBudget
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerConfig
from tests.engine.test_parity import make_prompts
from tests.engine.test_tp_engine import process_running, tp2, wait_until_gone

pytestmark = pytest.mark.timeout(300)
BLOCK_SIZE = 8


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_a_worker_of_two_ranks_rebuilds_in_place_and_decodes_as_one_rank(
    llama_dir: Path,
) -> None:
    prompts = make_prompts(seed=41)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one_rank = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE)
    expected = _tokens(one_rank, prompts, params)

    llm = tp2(llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=96)
    followers = llm._followers
    assert followers is not None
    pids = followers.pids
    load = LoadConfig(str(llama_dir), dtype="float32", device="cpu")
    parallel = ParallelConfig(tensor_parallel_size=2)
    engines = [llm.engine]
    try:
        assert _tokens(llm, prompts, params) == expected

        # the next role's configs give the cache the same shape: rank 0's is taken as it is
        cache = llm.engine.kv_cache
        weights = llm.engine.keep_for_next_role(keep_kv_cache=True)
        llm.engine.close()  # (its group went with the weights: the followers run on)
        same_shape = CacheConfig(BLOCK_SIZE, budget=KVBudget(num_blocks=96))
        chunked = SchedulerConfig(max_num_batched_tokens=32)  # (a prefill pool's budget)
        llm.engine = LLMEngine(load, same_shape, chunked, None, parallel, weights=weights)
        engines.append(llm.engine)
        assert llm.engine.kv_cache is cache and llm.engine.model is weights.model
        assert all(process_running(pid) for pid in pids)
        del cache
        assert _tokens(llm, prompts, params) == expected

        # and a cache of another size: every rank allocates its new one
        weights = llm.engine.keep_for_next_role(keep_kv_cache=True)
        larger = CacheConfig(BLOCK_SIZE, budget=KVBudget(num_blocks=128))
        llm.engine = LLMEngine(load, larger, SchedulerConfig(), None, parallel, weights=weights)
        engines.append(llm.engine)
        assert llm.engine.kv_cache.shape[2] == 128
        assert _tokens(llm, prompts, params) == expected
        assert followers.pids == pids  # the same follower processes all along
    finally:
        engines[-1].close()  # stops the followers
        llm.close()
    assert wait_until_gone(pids) == []


def test_kept_weights_build_only_a_worker_of_as_many_ranks(llama_dir: Path) -> None:
    llm = tp2(llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=64)
    followers = llm._followers
    assert followers is not None
    engine = llm.engine
    weights = engine.keep_for_next_role(keep_kv_cache=False)
    try:
        load = LoadConfig(str(llama_dir), dtype="float32", device="cpu")
        cache = CacheConfig(BLOCK_SIZE, budget=KVBudget(num_blocks=64))
        with pytest.raises(ValueError, match="kept by a worker of 2 ranks cannot build one of"):
            LLMEngine(load, cache, SchedulerConfig(), None, ParallelConfig(4), weights=weights)
    finally:
        engine.group = weights.group  # (given back, so that its close stops the followers)
        llm.close()
    assert wait_until_gone(followers.pids) == []
