"""Speculative decoding with a draft model (``"method": "draft_model"``): greedy output is the
tokens transformers' ``generate`` gives, in every engine mode, with drafts that stand and drafts
that fall; sampled output follows the target's distribution exactly; a draft model equal to
the target has every greedy draft stand (its cache, caught up after preemption, prefix hits and
forks, holds what the target's does); what the drafter cannot run is refused naming the field.

The target is the bundled demo model (trained: its greedy text is not noise). The draft that
disagrees now and then is a copy of it with every matrix scaled by 1 + 0.3 x N(0, 1) per
element: about half its drafts stand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench.draft_model import noisy_demo
from engine import LLM, SamplingParams
from engine.kv_cache.budget import KVLayout
from engine.speculative.config import SpeculativeConfig
from tests.engine.hf_reference import first_divergence_near_ties
from tests.engine.test_speculative_decoding import (
    DEMO_MODEL,
    assert_drafts_stood_and_fell,
    assert_samples_follow_top2_outcomes,
    expected,
    greedy,
    prompts,
)
from tests.fixtures.tiny_models import make_tiny_model

__all__ = ["expected", "prompts"]  # the fixtures, shared with the prompt-lookup tests
NUM_DRAFTS = 4


@pytest.fixture(scope="module")
def noisy_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, each of its matrices' elements scaled by 1 + 0.3 x N(0, 1) (seed 0)."""
    return noisy_demo(tmp_path_factory.mktemp("noisy-draft"))


def drafting_llm(draft: Path, **engine_args: object) -> LLM:
    spec = {"model": str(draft), "num_speculative_tokens": NUM_DRAFTS}
    options = {"dtype": "float32", "device": "cpu", **engine_args}
    return LLM(str(DEMO_MODEL), speculative_config=spec, **options)  # type: ignore[arg-type]


ENGINE_MODES = {
    "batched": {},
    "chunked": {"max_num_batched_tokens": 12},  # drafts compete with prompt chunks
    "preempted": {"block_size": 4, "num_kv_blocks": 30},
    # preempted, and its blocks back from the host tier (draft KV never goes there)
    "host-tier": {"block_size": 4, "num_kv_blocks": 30, "kv_offload_gb": 0.01},
    "prefix-cache": {},
}


def run_mode(llm: LLM, prompts: list[list[int]], mode: str) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy())
    if mode == "prefix-cache":  # again, from the cache: the drafter writes its own KV anew
        first = [o.outputs[0].token_ids for o in outputs]
        outputs = llm.generate(prompts, greedy())
        assert all(o.num_cached_tokens > 0 for o in outputs if len(o.prompt_token_ids) > 16)
        assert [o.outputs[0].token_ids for o in outputs] == first
    if mode in ("preempted", "host-tier"):
        assert llm.engine.num_preemptions > 0
    return [o.outputs[0].token_ids for o in outputs]


def test_speculative_config_takes_a_draft_model_as_vllm_and_names_bad_fields() -> None:
    spec = SpeculativeConfig.from_mapping({"model": "/m", "num_speculative_tokens": 3})
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/m", 3)
    explicit = {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    assert SpeculativeConfig.from_mapping(explicit) == spec
    refused = [
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model is required by"),
        ({"method": "ngram", "model": "/m", "num_speculative_tokens": 3}, "and by no other"),
        ({"model": "/m", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "ngram method's"),
        ({"model": 7, "num_speculative_tokens": 3}, "model must be a directory path, got int"),
        ({"method": "eagle", "model": "/m", "num_speculative_tokens": 3}, "ngram, draft_model"),
    ]
    for raw, message in refused:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_mapping(raw)


@pytest.mark.parametrize("mode", [m for m in ENGINE_MODES if m != "host-tier"])
def test_greedy_output_matches_transformers(
    prompts: list[list[int]], expected: list[list[int]], noisy_draft: Path, mode: str
) -> None:
    llm = drafting_llm(noisy_draft, **ENGINE_MODES[mode])
    assert run_mode(llm, prompts, mode) == expected
    assert_drafts_stood_and_fell(llm)


@pytest.mark.parametrize("mode", ["batched", "preempted", "host-tier", "prefix-cache", "chunked"])
def test_a_draft_model_equal_to_the_target_has_every_greedy_draft_stand(
    prompts: list[list[int]], expected: list[list[int]], mode: str
) -> None:
    """Its drafts are the target's own greedy tokens only if its cache holds what the
    target's does at every position it reads: after preemption (new blocks), prefix hits
    (blocks it did not write) and chunked prompts as well."""
    llm = drafting_llm(DEMO_MODEL, **ENGINE_MODES[mode])
    assert run_mode(llm, prompts, mode) == expected
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens, stats


def test_a_lone_sequence_takes_a_step_per_five_tokens_when_every_draft_stands(
    prompts: list[list[int]],
) -> None:
    """Slots past each step are given for the drafter to draft into: from the first decode on,
    a step verifies four drafts and adds them and one token."""
    llm = drafting_llm(DEMO_MODEL)
    params = SamplingParams(temperature=0.0, max_tokens=81, ignore_eos=True)
    llm.generate([prompts[2]], params)
    stats = llm.engine.stats
    assert stats.num_accepted_draft_tokens == stats.num_draft_tokens, stats
    assert stats.num_steps == 81 - stats.num_accepted_draft_tokens  # (the prompt's step: one)
    assert stats.num_steps <= 2 + 16  # (the first decode may have had room for fewer)


def test_parallel_samples_each_draft(prompts: list[list[int]], expected: list[list[int]]) -> None:
    """n = 3: the samples share the prompt's blocks; each drafts in its own once it decodes."""
    llm = drafting_llm(DEMO_MODEL, block_size=4)
    (out,) = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=48, n=3))
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 3
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens, stats


def test_sampled_output_follows_the_models_distribution(
    prompts: list[list[int]], noisy_draft: Path
) -> None:
    """Three tokens of top-k 2 sampling: eight possible outputs, whose probabilities come from
    transformers. Many requests at once, each sampled with the draft model's greedy drafts,
    must hit them in those proportions."""
    torch.manual_seed(5)
    assert_samples_follow_top2_outcomes(drafting_llm(noisy_draft, max_num_seqs=512), prompts[4])


def test_the_draft_cache_shares_the_kv_budget(noisy_draft: Path) -> None:
    """A byte budget holds as many blocks as fit the target's and the draft's K/V together."""
    budget = 1 << 20
    llm = drafting_llm(noisy_draft, kv_cache_memory_bytes=budget)
    layout = KVLayout(6, 4, 64, 16, torch.float32)  # the demo model's, as its copy's
    num_blocks = budget // (2 * layout.bytes_per_block)
    assert llm.engine.kv_cache.shape == layout.shape(num_blocks)
    drafter = llm.engine.runner.drafter
    assert drafter is not None and drafter.kv_cache.shape == layout.shape(num_blocks)


def _with_config(src: Path, out: Path, **changes: object) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_what_the_drafter_cannot_run_is_refused_naming_the_field(tmp_path: Path) -> None:
    mistral = make_tiny_model(
        tmp_path / "mistral", "MistralForCausalLM", vocab_size=4096, sliding_window=16
    )
    short = _with_config(DEMO_MODEL, tmp_path / "short", max_position_embeddings=64)
    refused = [
        ({}, tmp_path / "nothing", "speculative_config.model: .*config.json not found"),
        ({}, mistral, r"speculative_config.model \(MistralForCausalLM\) has sliding-window"),
        ({}, short, r"max_position_embeddings \(64\) must be >= the target's max_model_len"),
    ]
    for engine_args, draft, message in refused:
        with pytest.raises(ValueError, match=message):
            drafting_llm(draft, **engine_args)
    assert drafting_llm(short, max_model_len=64).engine.max_model_len == 64
    with pytest.raises(ValueError, match=r"the target model \(MistralForCausalLM\) has sliding"):
        spec = {"model": str(DEMO_MODEL), "num_speculative_tokens": 2}
        LLM(str(mistral), device="cpu", speculative_config=spec)


def test_no_drafting_while_the_batch_is_larger_than_disable_by_batch_size(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """Drafts off above two sequences: the draft model runs only once two remain (and catches
    up then), fewer forwards than drafting throughout; every draft still stands."""
    forwards = []
    for limit in (None, 2):
        spec = {
            "model": str(DEMO_MODEL),
            "num_speculative_tokens": 4,
            "disable_by_batch_size": limit,
        }
        llm = LLM(str(DEMO_MODEL), dtype="float32", device="cpu", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == expected
        stats = llm.engine.stats
        assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens
        assert llm.engine.runner.drafter is not None
        forwards.append(llm.engine.runner.drafter.num_forwards)
    assert 0 < forwards[1] < forwards[0] / 2, forwards


def test_a_worker_of_two_ranks_drafts_on_rank_0(
    prompts: list[list[int]], expected: list[list[int]], noisy_draft: Path
) -> None:
    """The draft model, whole, on rank 0 alone; the target over two ranks checks its drafts:
    transformers' tokens up to a near-tie at a first divergence (the ranks' all-reduce sums in
    another order than one device)."""
    llm = drafting_llm(noisy_draft, tensor_parallel_size=2, **ENGINE_MODES["preempted"])
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]
        assert len(first_divergence_near_ties(DEMO_MODEL, prompts, got, expected)) <= 1
        assert llm.engine.num_preemptions > 0
        assert_drafts_stood_and_fell(llm)
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_draft_model_gives_the_tokens_of_the_engine_without_it(
    prompts: list[list[int]], noisy_draft: Path
) -> None:
    """The draft's forwards (eager, on the Triton attention) beside the target's graphs."""
    plain = LLM(str(DEMO_MODEL), dtype="float32", device="cuda")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy())]
    for draft in (noisy_draft, DEMO_MODEL):
        llm = drafting_llm(draft, device="cuda")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == expected
        stats = llm.engine.stats
        assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens, stats
