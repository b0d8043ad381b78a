"""GLM-4.5 (``glm4_moe``): GQA attention with biased q/k/v, per-head q/k norms and rope on the
first half of each head, DeepSeek-V3's sparse MLP (sigmoid router with a correction bias,
shared experts, dense first layers) and a multi-token-prediction layer in the checkpoint.
Partial rotary embeddings also serve Phi-3's ``partial_rotary_factor`` (Phi-4-mini).

Greedy identity with transformers in every engine mode (batched, chunked prefill, prefix
hits, preemption, disaggregated, TP 2) is in the suites that run every architecture of
``tests.conftest.ARCHITECTURES``, GLM-4.5 among them (its multi-token-prediction layer skipped
at load: test_mla.py); here, what those do not cover."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_config import load_model_config, parse_model_config
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import make_prompts
from tests.fixtures.tiny_models import make_tiny_model

GLM = "Glm4MoeForCausalLM"
CPU = torch.device("cpu")


def _published(**changes: Any) -> dict[str, Any]:
    """GLM-4.5-Air's config.json as published (the keys the engine reads)."""
    raw = {
        "architectures": [GLM],
        "model_type": "glm4_moe",
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000000,
        "attention_bias": True,
        "use_qk_norm": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": [151329, 151336, 151338],
    }
    return {**raw, **changes}


def test_the_published_config_reads_as_transformers_builds_it() -> None:
    config = parse_model_config(_published())
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (96, 8, 128)
    assert config.rope_dim == 64 and config.rope.theta == 1e6  # rope on half of each head
    assert config.qkv_bias and not config.o_proj_bias and not config.qk_norm
    moe = config.moe
    assert moe is not None and moe.sparse_layers == tuple(range(1, 46))  # a dense first layer
    assert (moe.num_experts, moe.num_experts_per_token, moe.expert_intermediate_size) == (
        128,
        8,
        1408,
    )
    assert moe.shared_expert_intermediate_size == 1408 and not moe.shared_expert_gated
    assert (moe.scoring, moe.score_correction_bias, moe.group_score) == (
        "sigmoid",
        True,
        "top2_sum",
    )
    assert moe.normalize_top_k and moe.routed_scaling_factor == 1.0
    assert config.eos_token_ids == (151329, 151336, 151338)
    # GLM-4.5 (not Air) norms q and k per head
    assert parse_model_config(_published(use_qk_norm=True)).qk_norm
    # transformers' defaults where the keys are missing: half the head rotary, one shared
    # expert, and GLM routes as DeepSeek-V3 does whatever topk_method says
    bare = _published(topk_method="greedy")
    for key in ("partial_rotary_factor", "n_shared_experts"):
        del bare[key]
    config = parse_model_config(bare)
    assert config.rope_dim == 64 and config.moe is not None
    assert config.moe.shared_expert_intermediate_size == 1408
    assert config.moe.scoring == "sigmoid"
    # the transformers-v5 place of the factor: in rope_parameters
    v5 = _published(rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.25})
    del v5["partial_rotary_factor"]
    assert parse_model_config(v5).rope_dim == 32


def test_partial_rotary_embeddings_are_refused_where_the_attention_rotates_every_dim() -> None:
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "partial_rotary_factor": 0.5,
    }
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.5 is not supported for Llama"):
        parse_model_config(llama)
    with pytest.raises(
        ValueError, match=r"partial_rotary_factor 0.1015625 of head_dim 128 turns 13"
    ):
        parse_model_config(_published(partial_rotary_factor=0.1015625))  # not whole pairs
    with pytest.raises(ValueError, match=r"partial_rotary_factor 1.5 of head_dim 128"):
        parse_model_config(_published(partial_rotary_factor=1.5))


def test_phi3_with_rope_on_part_of_each_head_equals_transformers(tmp_path: Path) -> None:
    """Phi-4-mini's shape of Phi-3: LongRoPE on the first half of each head (4 frequency
    factors for 8 of 16 dims); greedy tokens equal transformers', in batches and chunked."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 1.5, 2.5, 4.0],
    }
    model_dir = make_tiny_model(tmp_path, "Phi3ForCausalLM", seed=3, rope_parameters=rope)
    assert load_model_config(model_dir).rope_dim == 8
    prompts = make_prompts(seed=4)[:4]
    expected = [hf_greedy(model_dir, prompt, 12) for prompt in prompts]
    for options in ({}, {"max_num_batched_tokens": 16}):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=8, **options)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        assert [o.outputs[0].token_ids for o in outputs] == expected, options
