"""Greedy decoding under tensor parallelism matches Hugging Face transformers, in every mode.

TP 2 on Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE and Phi-3 (and TP 4 on an MQA Mistral: one
KV head, replicated on every rank; batched and n > 1), each mode a check against the same LLM
where the mode is a request setting:
batched, chunked prefill, preemption, n > 1 (seeded samples equal TP 1's), prompt logprobs on
one LLM; async scheduling and prefix-cache hits on a second. The all-reduce sums in another
order than one device does, so a sample may differ from transformers only at a near-tie (top-2
logit gap under 1e-3) at its first divergence; the near-ties are counted, and must be few.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from tests.conftest import ARCHITECTURES
from tests.engine.hf_reference import first_divergence_near_ties
from tests.engine.test_parity import (
    greedy_params,
    make_prompts,
    preempting_blocks,
    reference,
    shared_prefix_prompts,
)
from tests.engine.test_prompt_logprobs import assert_matches_transformers
from tests.fixtures.tiny_models import make_tiny_model

MAX_NEAR_TIES = 1  # per comparison of a batch of prompts with transformers
MAX_NEAR_TIES_IN_ALL = 3  # over all the file's comparisons (25 batches of 8 prompts)
# chunks of 32 tokens, and 40 blocks of 8 tokens: the longest prompt (300 + 20 tokens) fills
# the cache alone, so the batch preempts
# num_kv_blocks: preempting_blocks (40 for a model of one KV cache group)
CHUNKED_PREEMPTING = {"block_size": 8, "max_num_batched_tokens": 32}
# a budget of 96 tokens admits later prompts after the shared prefixes are computed
ASYNC_PREFIX = {"block_size": 8, "max_num_batched_tokens": 96, "async_scheduling": True}


def assert_matches_transformers_greedy(
    llm: LLM,
    model_dir: Path,
    prompts: list[list[int]],
    key: str,
    near_ties: list[tuple[int, int, float]],
) -> list[RequestOutput]:
    """Greedy outputs of ``prompts`` that match transformers up to near-ties (added to
    ``near_ties``)."""
    outputs = llm.generate(prompts, greedy_params())
    got = [o.outputs[0].token_ids for o in outputs]
    found = first_divergence_near_ties(model_dir, prompts, got, reference(model_dir, prompts, key))
    assert len(found) <= MAX_NEAR_TIES, found
    near_ties.extend(found)
    return outputs


@pytest.fixture(scope="module")
def near_ties() -> Iterator[list[tuple[int, int, float]]]:
    """Every near-tie the file's comparisons met: reported, and few."""
    found: list[tuple[int, int, float]] = []
    yield found
    print(f"\nnear-ties at a first divergence from transformers: {len(found)} {found}")
    assert len(found) <= MAX_NEAR_TIES_IN_ALL, found


def tp_llm(model_dir: Path, size: int, **options: object) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        tensor_parallel_size=size,
        tensor_parallel_timeout_s=60.0,
        **options,  # type: ignore[arg-type]
    )


# Mixtral and Qwen3-MoE shard their experts as Qwen2-MoE does, DeepSeek-V2 its latent
# attention as DeepSeek-V3 does, Gemma 2 its layers as Gemma 3 does (test_tp_model checks
# all their ranks' logits and bytes): one of each kind here keeps the file's time down
_SHARDED_AS_ANOTHER = (
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "Gemma2ForCausalLM",
)
TP_ARCHITECTURES = tuple(arch for arch in ARCHITECTURES if arch not in _SHARDED_AS_ANOTHER)


@pytest.fixture(scope="module", params=TP_ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def chunked_tp2(model_dirs: dict[str, Path], arch: str) -> Iterator[LLM]:
    num_blocks = preempting_blocks(model_dirs[arch], step_tokens=32)
    llm = tp_llm(model_dirs[arch], 2, **{**CHUNKED_PREEMPTING, "num_kv_blocks": num_blocks})
    yield llm
    llm.close()


def test_batched_chunked_preempted_greedy_matches_transformers(
    chunked_tp2: LLM,
    model_dirs: dict[str, Path],
    arch: str,
    near_ties: list[tuple[int, int, float]],
) -> None:
    model_dir = model_dirs[arch]
    assert chunked_tp2.engine.kv_cache.shape[4] == 1  # 2 KV heads over 2 ranks
    preemptions = chunked_tp2.engine.num_preemptions
    prompts = make_prompts(seed=1)
    assert_matches_transformers_greedy(chunked_tp2, model_dir, prompts, "plain", near_ties)
    assert chunked_tp2.engine.num_preemptions > preemptions


def test_seeded_samples_equal_tensor_parallel_size_one(
    chunked_tp2: LLM, model_dirs: dict[str, Path], arch: str
) -> None:
    prompts = make_prompts(seed=3)[2:6]
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=3, seed=100 + i)
        for i in range(len(prompts))
    ]
    one_rank = LLM(str(model_dirs[arch]), dtype="float32", device="cpu", skip_tokenizer_init=True)
    expected = [[c.token_ids for c in o.outputs] for o in one_rank.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in chunked_tp2.generate(prompts, params)]
    assert got == expected


def test_prompt_logprobs_match_transformers(
    chunked_tp2: LLM, model_dirs: dict[str, Path], arch: str
) -> None:
    prompts = make_prompts(seed=21)[:5]  # 1, 3, 17, 40 and 64 tokens
    num_tops = [3, 0, 20, 5, 2]
    params = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=k) for k in num_tops]
    outputs = chunked_tp2.generate(prompts, params)
    for prompt, out, num_top in zip(prompts, outputs, num_tops, strict=True):
        assert_matches_transformers(model_dirs[arch], prompt, out.prompt_logprobs, num_top)


def test_async_scheduling_and_prefix_hits_match_transformers(
    model_dirs: dict[str, Path], arch: str, near_ties: list[tuple[int, int, float]]
) -> None:
    model_dir = model_dirs[arch]
    llm = tp_llm(model_dir, 2, **ASYNC_PREFIX)
    try:
        assert_matches_transformers_greedy(llm, model_dir, make_prompts(seed=1), "plain", near_ties)
        prompts = shared_prefix_prompts(seed=2)
        for run in range(2):
            outputs = assert_matches_transformers_greedy(
                llm, model_dir, prompts, "shared-prefix", near_ties
            )
            if run == 0:  # shared prefixes within one batch
                assert sum(o.num_cached_tokens > 0 for o in outputs) >= 4
            else:  # everything seen before
                assert all(o.num_cached_tokens >= 64 for o in outputs)
    finally:
        llm.close()


def test_mqa_over_four_ranks_replicates_its_kv_head_and_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory, near_ties: list[tuple[int, int, float]]
) -> None:
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("mqa"), "MistralForCausalLM", seed=7, num_key_value_heads=1
    )
    llm = tp_llm(model_dir, 4, block_size=8)  # 4 processes on the cores: few, large steps
    try:
        assert llm.engine.shard.kv_heads == range(0, 1)  # every rank holds the one KV head
        assert llm.engine.kv_cache.shape[4] == 1
        prompts = make_prompts(seed=1)
        assert_matches_transformers_greedy(llm, model_dir, prompts, "plain", near_ties)
        (sampled,) = llm.generate(
            make_prompts(seed=3)[4], SamplingParams(temperature=0.0, max_tokens=20, n=3)
        )
        assert len({tuple(c.token_ids) for c in sampled.outputs}) == 1  # greedy samples agree
    finally:
        llm.close()
