"""gpt-oss: its config, its router and clamped-SwiGLU experts against transformers', and its
stacked checkpoint tensors.

Greedy identity with transformers in every engine mode (attention sinks, alternating sliding
and full layers, yarn rope without truncation) is in the suites that run every architecture of
``tests.conftest.ARCHITECTURES``, gpt-oss included (on CPU through the C kernels); here, the
Triton kernels with its sinks, and with Gemma 2's soft-capped logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

from engine import LLM, SamplingParams
from engine.kernels.linear import onednn_supports
from engine.model_config import load_model_config, parse_model_config
from engine.model_loader import load_model
from engine.models.moe import ClampedSwigluExperts, Router
from engine.models.rms_norm import OffsetRMSNorm, rms_norm_for
from tests.engine.hf_reference import hf_greedy
from tests.fixtures.tiny_models import tiny_hf_config

GPT_OSS = "GptOssForCausalLM"


def _raw(**overrides: Any) -> dict[str, Any]:
    return {**tiny_hf_config(GPT_OSS).to_dict(), **overrides}


def test_config_reads_sinks_windows_and_the_experts() -> None:
    config = parse_model_config(_raw())
    moe = config.moe
    assert moe is not None
    assert config.attention_sinks and config.norm_scale_in_float32
    assert config.qkv_bias and config.o_proj_bias  # attention_bias
    assert (config.sliding_window, config.sliding_layers) == (24, (0,))
    assert config.rope.scaling_type == "yarn" and not config.rope.truncate
    assert (moe.num_experts, moe.num_experts_per_token, moe.expert_intermediate_size) == (4, 2, 32)
    assert moe.sparse_layers == (0, 1) and moe.router_bias and moe.softmax_after_top_k
    assert (moe.expert_activation, moe.swiglu_alpha, moe.swiglu_limit) == (
        "clamped_swiglu",
        1.702,
        1.5,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"swiglu_limit": 0.0}, "swiglu_limit 0.0 must be positive"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok 5 must be in 1 \.\. 4"),
    ],
)
def test_bad_gpt_oss_configs_are_refused_naming_the_field(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_config(_raw(**overrides))


def test_router_and_experts_equal_transformers() -> None:
    hf_config = tiny_hf_config(GPT_OSS)
    config = parse_model_config(hf_config.to_dict())
    assert config.moe is not None
    torch.manual_seed(0)
    hf_router, hf_experts = (
        hf_gpt_oss.GptOssTopKRouter(hf_config),
        hf_gpt_oss.GptOssExperts(hf_config),
    )
    router = Router(config.moe, config.hidden_size)
    experts = ClampedSwigluExperts(
        config.moe, config.hidden_size, config.moe.expert_intermediate_size
    )
    with torch.no_grad():
        for param in [*hf_router.parameters(), *hf_experts.parameters()]:
            param.normal_(0.0, 0.3)
        router.weight.copy_(hf_router.weight)
        assert router.bias is not None
        router.bias.copy_(hf_router.bias)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(experts, name).copy_(getattr(hf_experts, name))
        x = torch.randn(50, config.hidden_size) * 3  # large enough for the clamps to bite
        _, hf_weights, hf_ids = hf_router(x)
        weights, ids = router(x)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
        out, counts = experts(x, weights, ids)
        torch.testing.assert_close(out, hf_experts(x, hf_ids, hf_weights), atol=1e-5, rtol=1e-5)
        assert sum(counts) == 50 * 2
        # the clamps bite: without them the experts' outputs differ
        unclamped = ClampedSwigluExperts(config.moe, config.hidden_size, 32)
        unclamped.load_state_dict(experts.state_dict())
        unclamped.limit = 1e9
        assert not torch.allclose(unclamped(x, weights, ids)[0], out, atol=1e-3)


@pytest.mark.skipif(
    not onednn_supports(torch.device("cpu"), torch.float32),
    reason="oneDNN's packed linear is not in this build",
)
@pytest.mark.parametrize("num_tokens", [3, 200])
def test_experts_packed_for_onednn_equal_the_stacked_ones(num_tokens: int) -> None:
    """On a CPU the loader packs each expert's projections and biases for oneDNN (transposed
    into ``x @ W.T`` form) and gives up the stacked weights; its rows run through them (200
    tokens of top 2 of 4: about 100 rows an expert, padded to oneDNN's row buckets), clamped
    as before, and equal the stacked experts' outputs."""
    config = parse_model_config(tiny_hf_config(GPT_OSS).to_dict())
    assert config.moe is not None
    torch.manual_seed(num_tokens)
    router = Router(config.moe, config.hidden_size)
    stacked = ClampedSwigluExperts(config.moe, config.hidden_size, 32)
    packed = ClampedSwigluExperts(config.moe, config.hidden_size, 32)
    with torch.no_grad():
        for param in [*router.parameters(), *stacked.parameters()]:
            param.normal_(0.0, 0.3)
        packed.load_state_dict(stacked.state_dict())
        packed.pack_for_onednn()
        packed.pack_for_onednn()  # (packed once: a kept model's experts stay packed)
        assert packed.gate_up_proj.numel() == packed.down_proj_bias.numel() == 0
        assert len(packed.packed_gate_up) == len(packed.packed_down) == config.moe.num_experts
        x = torch.randn(num_tokens, config.hidden_size) * 3  # the clamps bite
        weights, ids = router(x)
        expected, expected_counts = stacked(x, weights, ids)
        out, counts = packed(x, weights, ids)
    assert counts == expected_counts
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_cpu_engine_runs_the_experts_through_onednn(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs[GPT_OSS]
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    for backend in ("onednn", "torch"):
        if backend == "onednn" and not onednn_supports(cpu, torch.float32):
            continue
        model = load_model(model_dir, config, torch.float32, cpu, linear_backend=backend)
        experts = [m for m in model.modules() if isinstance(m, ClampedSwigluExperts)]
        assert experts
        assert all(bool(e.packed_gate_up) is (backend == "onednn") for e in experts), backend


def test_checkpoint_stores_the_experts_stacked_as_the_engine_holds_them(
    model_dirs: dict[str, Path],
) -> None:
    """gpt-oss publishes each layer's experts as stacked tensors, [experts, hidden, 2 x width]
    with gate and up columns interleaved, which the loader reads as they are (a rank its
    contiguous range of pairs: tests/engine/test_tp_model.py)."""
    with safe_open(str(model_dirs[GPT_OSS] / "model.safetensors"), "pt") as checkpoint:
        names = set(checkpoint.keys())
        shape = checkpoint.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape == [4, 64, 64]
    assert {
        "model.layers.0.mlp.router.bias",
        "model.layers.0.self_attn.sinks",
        "model.layers.0.mlp.experts.down_proj_bias",
    } <= names


@pytest.mark.parametrize("architecture", [GPT_OSS, "Gemma2ForCausalLM"])
def test_sinks_and_soft_caps_through_the_triton_backend_match_transformers(
    model_dirs: dict[str, Path], architecture: str
) -> None:
    """The Triton kernels (Triton's interpreter on CPU) with gpt-oss's sinks and Gemma 2's
    soft-capped logits, each beside sliding-window layers, in chunked prefill and decode."""
    model_dir = model_dirs[architecture]
    prompts = [list(range(5, 5 + n)) for n in (3, 30, 41)]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        block_size=8,
        max_num_batched_tokens=24,
    )
    assert llm.engine.runner.attn_backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    expected = [hf_greedy(model_dir, prompt, 6) for prompt in prompts]
    assert [output.outputs[0].token_ids for output in outputs] == expected


def test_norm_scales_before_the_cast_as_transformers_does() -> None:
    """GptOssRMSNorm multiplies by its weight in float32 and casts after (Llama's casts
    first): in bfloat16 the engine's norm gives its bits."""
    config = parse_model_config(_raw())
    ours = rms_norm_for(config, 64)
    reference = hf_gpt_oss.GptOssRMSNorm(64, eps=config.rms_norm_eps)
    with torch.no_grad():
        reference.weight.normal_(1.0, 0.3)
        ours.weight.copy_(reference.weight)
    ours, reference = ours.to(torch.bfloat16), reference.to(torch.bfloat16)
    x = torch.randn(33, 64).to(torch.bfloat16)
    assert isinstance(ours, OffsetRMSNorm) and torch.equal(ours(x), reference(x))
