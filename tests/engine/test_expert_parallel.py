"""Expert parallelism: a mixture-of-experts model's routed experts dealt out whole over a
worker's tensor-parallel ranks (``enable_expert_parallel``), its greedy tokens still
transformers', in every mode.

Each rank routes every token, runs only the pairs of its own run of experts and the one
all-reduce adds the ranks' shares, so the sums come in another order than one device's: a
sample may differ from transformers only at a near-tie at its first divergence, as under
tensor parallelism (tests/engine/test_tp_parity.py). Qwen2-MoE (a gated shared expert, eight
experts over two ranks), DeepSeek-V3 (grouped top-k over latent attention) and gpt-oss (the
experts' down-projection biases, each added by the rank holding its expert) run batched,
chunked and preempted; prefix hits on Qwen2-MoE. The ranks' logits and bytes, for every
mixture-of-experts family, are tests/engine/test_tp_model.py's.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.models.moe import ClampedSwigluExperts, RoutedExperts
from tests.engine.test_parity import make_prompts, preempting_blocks, shared_prefix_prompts
from tests.engine.test_tp_parity import (
    CHUNKED_PREEMPTING,
    MAX_NEAR_TIES_IN_ALL,
    assert_matches_transformers_greedy,
    tp_llm,
)
from tests.fixtures.tiny_models import make_tiny_model

EP_ARCHITECTURES = ("Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")


@pytest.fixture(scope="module")
def near_ties() -> Iterator[list[tuple[int, int, float]]]:
    found: list[tuple[int, int, float]] = []
    yield found
    print(f"\nnear-ties at a first divergence from transformers: {len(found)} {found}")
    assert len(found) <= MAX_NEAR_TIES_IN_ALL, found


def ep_llm(model_dir: Path, **options: object) -> LLM:
    return tp_llm(model_dir, 2, enable_expert_parallel=True, **options)


def held_runs(llm: LLM) -> list[range]:
    """The experts rank 0's sparse layers hold."""
    return [
        m.held
        for m in llm.engine.model.modules()
        if isinstance(m, (RoutedExperts, ClampedSwigluExperts))
    ]


@pytest.mark.parametrize("arch", EP_ARCHITECTURES)
def test_batched_chunked_preempted_greedy_matches_transformers(
    model_dirs: dict[str, Path], arch: str, near_ties: list[tuple[int, int, float]]
) -> None:
    model_dir = model_dirs[arch]
    num_blocks = preempting_blocks(model_dir, step_tokens=32)
    llm = ep_llm(model_dir, **{**CHUNKED_PREEMPTING, "num_kv_blocks": num_blocks})
    try:
        runs = held_runs(llm)
        num_experts = llm.engine.model_config.moe.num_experts  # type: ignore[union-attr]
        assert runs and all(run == range(0, num_experts // 2) for run in runs)
        assert llm.engine.shard.expert_parallel
        preemptions = llm.engine.num_preemptions
        assert_matches_transformers_greedy(llm, model_dir, make_prompts(seed=1), "plain", near_ties)
        assert llm.engine.num_preemptions > preemptions
    finally:
        llm.close()


def test_prefix_hits_and_seeded_samples(
    model_dirs: dict[str, Path], near_ties: list[tuple[int, int, float]]
) -> None:
    """Qwen2-MoE: cached prefixes give transformers' tokens; seeded samples (n > 1) are the
    one-rank engine's."""
    model_dir = model_dirs["Qwen2MoeForCausalLM"]
    llm = ep_llm(model_dir, block_size=8)
    try:
        prompts = shared_prefix_prompts(seed=2)
        for run in range(2):
            outputs = assert_matches_transformers_greedy(
                llm, model_dir, prompts, "shared-prefix", near_ties
            )
            if run == 1:
                assert all(o.num_cached_tokens >= 64 for o in outputs)
        sampled = make_prompts(seed=3)[2:6]
        params = [
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=3, seed=100 + i)
            for i in range(len(sampled))
        ]
        one_rank = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
        expected = [[c.token_ids for c in o.outputs] for o in one_rank.generate(sampled, params)]
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(sampled, params)]
        assert got == expected
    finally:
        llm.close()


def test_expert_parallelism_needs_an_expert_per_rank_before_any_process_starts(
    tmp_path: Path,
) -> None:
    """Two experts cannot be dealt out over four ranks; the error names the field and the
    numbers, and no rank process is started."""
    model_dir = make_tiny_model(tmp_path, "MixtralForCausalLM", seed=3, num_local_experts=2)
    before = set(multiprocessing.active_children())
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size 4 with expert parallelism must "
        "be at most the routed experts, num_experts 2",
    ):
        tp_llm(model_dir, 4, enable_expert_parallel=True)
    assert set(multiprocessing.active_children()) == before
    tp_llm(model_dir, 4).close()  # the experts' columns split over four ranks as before


def test_tokens_per_expert_count_every_experts_tokens(model_dirs: dict[str, Path]) -> None:
    """The metric of tokens per expert (rank 0's counts) covers the experts the other rank
    holds: Qwen3-MoE's six experts, three a rank, count what the one-rank engine counts."""
    model_dir = model_dirs["Qwen3MoeForCausalLM"]
    prompts = make_prompts(seed=4)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    one_rank = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
    expected = [o.outputs[0].token_ids for o in one_rank.generate(prompts, params)]
    llm = ep_llm(model_dir)
    try:
        assert set(held_runs(llm)) == {range(0, 3)}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        counts = llm.engine.runner.expert_tokens
        one_rank_counts = one_rank.engine.runner.expert_tokens
        assert counts is not None and one_rank_counts is not None
        assert counts.per_expert() == one_rank_counts.per_expert()
        assert all(n > 0 for n in counts.per_expert()[3:])  # the other rank's experts
    finally:
        llm.close()
