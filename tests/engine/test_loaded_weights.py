"""An engine built on another engine's weights (``LLMEngine(weights=...)``, what a worker that
changes role does): the same model object, nothing loaded again, the same greedy tokens as the
offline engine; weights loaded otherwise (another dtype, another model) are refused by name."""

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


def _engine(model_dir: Path, dtype: str = "float32", **kwargs: object) -> LLMEngine:
    load = LoadConfig(str(model_dir), dtype=dtype, device="cpu")
    return LLMEngine(load, CACHE, SchedulerConfig(), **kwargs)  # type: ignore[arg-type]


def _greedy(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [event.token_id for event in engine.step().new_tokens]
    return tokens


def test_an_engine_on_kept_weights_serves_as_the_offline_engine(llama_dir: Path) -> None:
    first = _engine(llama_dir)
    weights = first.loaded_weights()
    second = _engine(llama_dir, weights=weights)
    assert second.model is first.model
    assert second.kv_cache.data_ptr() != first.kv_cache.data_ptr()  # a cache of its own
    prompt = make_prompts(seed=5)[0]
    offline = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    expected = offline.generate([prompt], params)[0].outputs[0].token_ids
    assert _greedy(second, prompt, 7) == expected


def test_weights_loaded_otherwise_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    weights = _engine(llama_dir).loaded_weights()
    with pytest.raises(ValueError, match="a worker keeps its weights only for the same model"):
        _engine(llama_dir, dtype="bfloat16", weights=weights)
