"""Gemma 2 and Gemma 3 (text): their configs (Gemma 3's in both spellings), the norm and Gemma
3's two ropes against transformers, what Gemma 2's soft-capping does, and samples drawn from
its capped logits.

Greedy identity with transformers in every engine mode is in the suites that run every
architecture of ``tests.conftest.ARCHITECTURES`` (test_parity.py, test_models.py,
test_async_scheduling.py, test_tp_model.py, test_tp_parity.py), both Gemmas included.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3

from engine import LLM, SamplingParams
from engine.model_config import parse_model_config
from engine.model_loader import load_model
from engine.models.rms_norm import OffsetRMSNorm
from engine.models.rope import RotaryEmbedding
from tests.engine.hf_reference import hf_model
from tests.fixtures.tiny_models import make_tiny_model, tiny_hf_config

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"


def _raw(architecture: str = GEMMA3, **overrides: Any) -> dict[str, Any]:
    return {**tiny_hf_config(architecture).to_dict(), **overrides}


def test_config_reads_gemmas_choices() -> None:
    config = parse_model_config(_raw())
    assert (config.activation, config.norm_weight_offset, config.sandwich_norms) == (
        "gelu_tanh",
        1.0,
        True,
    )
    assert config.embedding_multiplier == math.sqrt(64) and config.qk_norm
    assert config.attention_scale == 32**-0.5  # query_pre_attn_scalar, not head_dim
    assert (config.sliding_window, config.sliding_layers) == (24, (0, 2))
    assert config.rope.theta == 1e6 and config.rope.scaling_type == "linear"
    assert config.local_rope is not None and config.local_rope.theta == 10000.0
    assert config.local_rope.scaling_type == "default" and config.final_logit_softcap == 30.0


def test_older_config_keys_give_the_same_ropes_and_layers() -> None:
    """rope_theta, rope_scaling (the global layers') and rope_local_base_freq; every sixth
    layer global when layer_types is absent."""
    raw = _raw(
        rope_parameters=None,
        rope_theta=5e5,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=20000.0,
        layer_types=None,
        num_hidden_layers=12,
    )
    config = parse_model_config(raw)
    assert (config.rope.theta, config.rope.scaling_type, config.rope.factor) == (
        5e5,
        "linear",
        8.0,
    )
    assert config.local_rope is not None and config.local_rope.theta == 20000.0
    assert config.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)


def test_gemma2_config_reads_its_soft_caps_and_alternating_layers() -> None:
    config = parse_model_config(_raw(GEMMA2))
    assert (config.attention_logit_softcap, config.final_logit_softcap) == (5.0, 10.0)
    assert config.sliding_layers == (0, 2) and config.sliding_window == 24
    assert config.local_rope is None and not config.qk_norm and config.sandwich_norms
    # transformers' defaults when config.json leaves the caps out
    raw = _raw(GEMMA2)
    del raw["attn_logit_softcapping"], raw["final_logit_softcapping"]
    defaults = parse_model_config(raw)
    assert (defaults.attention_logit_softcap, defaults.final_logit_softcap) == (50.0, 30.0)


@pytest.mark.parametrize("architecture", [GEMMA2, GEMMA3])
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_activation": "relu"}, "unsupported hidden_activation 'relu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_gemma_configs_are_refused_naming_the_field(
    architecture: str, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_config(_raw(architecture, **overrides))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_equals_transformers_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ours, reference = OffsetRMSNorm(64, 1e-6, 1.0), hf_gemma3.Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.1)
        ours.weight.copy_(reference.weight)
    ours, reference = ours.to(dtype), reference.to(dtype)
    x = torch.randn(9, 64).to(dtype)
    assert torch.equal(ours(x), reference(x))


def test_both_ropes_equal_transformers() -> None:
    hf_config = tiny_hf_config(GEMMA3)
    config = parse_model_config(hf_config.to_dict())
    reference = hf_gemma3.Gemma3RotaryEmbedding(hf_config)
    positions = torch.arange(config.max_position_embeddings)
    assert config.local_rope is not None
    for rope, layer_type in (
        (config.rope, "full_attention"),
        (config.local_rope, "sliding_attention"),
    ):
        cos, sin = RotaryEmbedding(config.rope_dim, config.max_position_embeddings, rope)(
            positions, torch.float32
        )
        hf_cos, hf_sin = reference(torch.zeros(1), positions[None], layer_type)
        half = config.rope_dim // 2
        torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], atol=0, rtol=0)
        torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], atol=0, rtol=0)


def test_dummy_weights_make_every_norm_scale_by_one(tmp_path: Any) -> None:
    tiny_hf_config(GEMMA3).save_pretrained(str(tmp_path))
    config = parse_model_config(tiny_hf_config(GEMMA3).to_dict())
    model = load_model(tmp_path, config, torch.float32, torch.device("cpu"), load_format="dummy")
    norms = [m for m in model.modules() if isinstance(m, OffsetRMSNorm)]
    assert len(norms) == 1 + 3 * 6  # final; per layer input, q, k, post-attn, pre- and post-MLP
    assert all(torch.equal(m.weight, torch.zeros_like(m.weight)) for m in norms)


def test_samples_follow_transformers_soft_capped_distribution(tmp_path: Path) -> None:
    """The engine's first tokens, drawn at temperature 1 from the top 8, follow the
    distribution of transformers' logits, which Gemma 2 caps (here at 2) before any sampling:
    a chi-square test accepts it, and rejects the uncapped logits' distribution (so the cap
    bends these logits enough to be seen)."""
    model_dir = make_tiny_model(tmp_path, GEMMA2, seed=31, final_logit_softcapping=2.0)
    prompt = [5, 77, 301, 12, 950, 40, 41, 600, 3, 88]
    with torch.no_grad():
        capped = hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1].double().numpy()
    assert np.abs(capped).max() < 2.0
    uncapped = 2.0 * np.arctanh(capped / 2.0)
    top = np.argsort(-capped)[:8]
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", max_num_seqs=500, skip_tokenizer_init=True
    )
    counts = np.zeros(len(capped), dtype=np.int64)
    for seed in range(4):
        params = SamplingParams(temperature=1.0, top_k=8, max_tokens=1, n=500, seed=seed)
        (out,) = llm.generate([prompt], params)
        for sample in out.outputs:
            counts[sample.token_ids[0]] += 1
    assert counts[top].sum() == counts.sum() == 2000  # nothing outside the top 8

    def pvalue(logits: np.ndarray) -> float:
        probs = np.exp(logits[top] - logits[top].max())
        return float(chisquare(counts[top], probs / probs.sum() * counts.sum()).pvalue)

    assert pvalue(capped) > 1e-3
    assert pvalue(uncapped) < 1e-3
