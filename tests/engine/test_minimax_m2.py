"""MiniMax-M2's q and k norms over all heads at once, on tensor-parallel ranks that each hold
a slice of the heads: the squares' sum is all-reduced, and a KV head replicated on several
ranks (more ranks than KV heads) counted once. Greedy identity with transformers in every
engine mode (TP 2 over two KV heads included) is in the suites that run every architecture of
``tests.conftest.ARCHITECTURES``; here, the replicated case."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from tests.engine.hf_reference import first_divergence_near_ties, hf_greedy
from tests.engine.test_parity import make_prompts
from tests.fixtures.tiny_models import make_tiny_model


def test_one_kv_head_on_two_ranks_equals_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "MiniMaxM2ForCausalLM", seed=5, num_key_value_heads=1)
    prompts = make_prompts(seed=6)[:4]
    expected = [hf_greedy(model_dir, prompt, 10) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    one = LLM(str(model_dir), dtype="float32", device="cpu", block_size=8)
    assert [o.outputs[0].token_ids for o in one.generate(prompts, params)] == expected
    two = LLM(str(model_dir), dtype="float32", device="cpu", block_size=8, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    finally:
        two.close()
    # (the all-reduce sums in another order: identical, or a near-tie at the first divergence)
    assert len(first_divergence_near_ties(model_dir, prompts, got, expected)) <= 1
