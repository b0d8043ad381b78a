"""An engine built on another engine's weights (``LLMEngine(weights=...)``, what a worker that
changes role does): the same model object, nothing loaded again, the KV cache taken over when it
has the new engine's shape (its old contents unread), the same greedy tokens as the offline
engine; weights loaded otherwise (another dtype, another model) are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerConfig
from tests.engine.test_parity import make_prompts

CACHE = CacheConfig(block_size=8, budget=KVBudget(num_blocks=64))


def _engine(
    model_dir: Path, dtype: str = "float32", cache: CacheConfig = CACHE, **kwargs: object
) -> LLMEngine:
    load = LoadConfig(str(model_dir), dtype=dtype, device="cpu")
    return LLMEngine(load, cache, SchedulerConfig(), **kwargs)  # type: ignore[arg-type]


def _greedy(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [event.token_id for event in engine.step().new_tokens]
    return tokens


@pytest.mark.parametrize(
    ("num_blocks", "keep"),
    [(64, True), (48, True), (64, False)],
    ids=["same-cache", "other-cache", "cache-not-kept"],
)
def test_an_engine_on_kept_weights_serves_as_the_offline_engine(
    llama_dir: Path, num_blocks: int, keep: bool
) -> None:
    first = _engine(llama_dir)
    prompts = make_prompts(seed=5)
    _greedy(first, prompts[1], 9)  # its cache holds KV the next engine must not read
    weights = first.rank_model.loaded_weights(keep_kv_cache=keep)
    cache = CacheConfig(block_size=8, budget=KVBudget(num_blocks=num_blocks))
    second = _engine(llama_dir, weights=weights, cache=cache)
    assert second.model is first.model
    # the first's cache, taken over where kept and fitting; a cache of its own otherwise
    assert (second.kv_cache is first.kv_cache) == (keep and num_blocks == 64)
    assert second.kv_cache.shape[2] == num_blocks
    offline = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    expected = offline.generate([prompts[0]], params)[0].outputs[0].token_ids
    assert _greedy(second, prompts[0], 7) == expected


def test_weights_loaded_otherwise_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    weights = _engine(llama_dir).rank_model.loaded_weights()
    with pytest.raises(ValueError, match="a worker keeps its weights only for the same model"):
        _engine(llama_dir, dtype="bfloat16", weights=weights)
