"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): their configs, the grouping of
tokens by expert, the checkpoint names each publishes, and the tokens-per-expert counts.

Greedy identity with transformers in every engine mode is in test_parity.py, test_models.py,
test_async_scheduling.py and test_tp_parity.py, which run every architecture of
``tests.conftest.ARCHITECTURES``, these three included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.kernels.linear import onednn_supports
from engine.model_config import load_model_config, parse_model_config
from engine.model_loader import load_model
from engine.models.expert_tokens import ExpertTokenCounts
from engine.models.moe import RoutedExperts, route
from engine.moe_config import MoeConfig
from engine.parallel.shard import TensorParallelShard
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import make_prompts
from tests.fixtures.tiny_models import make_tiny_model

CPU = torch.device("cpu")


def _softmax_top_k(num_experts: int, top_k: int, normalize: bool) -> MoeConfig:
    """Mixtral's and Qwen's router: the top k of a softmax."""
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=8,
        normalize_top_k=normalize,
        sparse_layers=(0,),
        shared_expert_intermediate_size=0,
    )


def _raw(architecture: str, **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    return {**raw, **overrides}


def test_mixtral_routes_every_layer_and_renormalises_its_top_k() -> None:
    moe = parse_model_config(_raw("MixtralForCausalLM")).moe
    assert moe == MoeConfig(
        num_experts=8,  # transformers' defaults: num_local_experts 8, top 2
        num_experts_per_token=2,
        expert_intermediate_size=96,  # Mixtral's experts are intermediate_size wide
        normalize_top_k=True,
        sparse_layers=(0, 1, 2, 3),
        shared_expert_intermediate_size=0,
    )


def test_qwen_moe_sparse_layers_follow_the_step_and_the_dense_list() -> None:
    raw = _raw(
        "Qwen2MoeForCausalLM",
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    config = parse_model_config(raw)
    assert config.moe is not None
    assert config.moe.sparse_layers == (1,)  # layers 1 and 3 by the step, 3 kept dense
    assert config.moe.shared_expert_intermediate_size == 48
    assert not config.moe.normalize_top_k  # Qwen2-MoE's default
    assert config.qkv_bias and not config.o_proj_bias
    qwen3 = parse_model_config(_raw("Qwen3MoeForCausalLM", norm_topk_prob=True))
    assert qwen3.moe is not None and qwen3.qk_norm and not qwen3.qkv_bias
    assert qwen3.moe.normalize_top_k and qwen3.moe.shared_expert_intermediate_size == 0
    assert (qwen3.moe.num_experts, qwen3.moe.num_experts_per_token) == (128, 8)
    assert parse_model_config(_raw("LlamaForCausalLM")).moe is None


def test_bad_moe_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be in 1 .. 8"):
        parse_model_config(_raw("MixtralForCausalLM", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="decoder_sparse_step 0"):
        parse_model_config(_raw("Qwen3MoeForCausalLM", decoder_sparse_step=0))
    config = parse_model_config(_raw("Qwen2MoeForCausalLM", moe_intermediate_size=30))
    with pytest.raises(ValueError, match="must divide moe_intermediate_size 30"):
        TensorParallelShard.of(config, 0, 4)


def test_each_rank_holds_its_columns_of_every_expert() -> None:
    config = parse_model_config(
        _raw("Qwen2MoeForCausalLM", moe_intermediate_size=32, shared_expert_intermediate_size=48)
    )
    shards = [TensorParallelShard.of(config, rank, 2) for rank in range(2)]
    assert [s.expert_intermediate for s in shards] == [range(0, 16), range(16, 32)]
    assert [s.shared_expert_intermediate for s in shards] == [range(0, 24), range(24, 48)]
    dense = TensorParallelShard.whole(parse_model_config(_raw("LlamaForCausalLM")))
    assert dense.expert_intermediate == range(0) == dense.shared_expert_intermediate


def _per_token_reference(
    experts: RoutedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Each token through its experts one at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    width = down.shape[2]
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            gate_up_out = gate_up[expert] @ x[token].double()
            hidden = torch.nn.functional.silu(gate_up_out[:width]) * gate_up_out[width:]
            out[token] += float(weights[token, slot]) * (down[expert] @ hidden)
    return out


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (7, 2), (40, 3)])
def test_tokens_grouped_by_expert_equal_each_token_through_its_experts(
    num_tokens: int, top_k: int
) -> None:
    torch.manual_seed(num_tokens)
    experts = RoutedExperts(num_experts=6, hidden_size=16, intermediate=8)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
        x = torch.randn(num_tokens, 16)
        weights, ids = route(torch.randn(num_tokens, 6), _softmax_top_k(6, top_k, top_k > 1))
        out, counts = experts(x, weights, ids)
    reference = _per_token_reference(experts, x, weights, ids)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    assert counts == torch.bincount(ids.reshape(-1), minlength=6).tolist()
    assert sum(counts) == num_tokens * top_k


@pytest.mark.skipif(
    not onednn_supports(CPU, torch.float32), reason="oneDNN's packed linear is not in this build"
)
@pytest.mark.parametrize("num_tokens", [3, 200])
def test_experts_packed_for_onednn_equal_the_stacked_ones(num_tokens: int) -> None:
    """On a CPU the loader packs each expert's projections for oneDNN and gives up the stacked
    weights; its rows run through them (200 tokens of top 2 of 4 experts: about 100 rows an
    expert, padded to oneDNN's row buckets) and equal the stacked experts' outputs."""
    torch.manual_seed(num_tokens)
    stacked = RoutedExperts(num_experts=4, hidden_size=32, intermediate=24)
    packed = RoutedExperts(num_experts=4, hidden_size=32, intermediate=24)
    with torch.no_grad():
        stacked.gate_up_proj.normal_(0, 0.3)
        stacked.down_proj.normal_(0, 0.3)
        packed.load_state_dict(stacked.state_dict())
        packed.pack_for_onednn()
        packed.pack_for_onednn()  # (packed once: a kept model's experts stay packed)
        assert packed.gate_up_proj.numel() == packed.down_proj.numel() == 0
        assert len(packed.packed_gate_up) == len(packed.packed_down) == 4
        x = torch.randn(num_tokens, 32)
        weights, ids = route(torch.randn(num_tokens, 4), _softmax_top_k(4, 2, True))
        expected, expected_counts = stacked(x, weights, ids)
        out, counts = packed(x, weights, ids)
    assert counts == expected_counts
    assert max(counts) > 64 if num_tokens == 200 else max(counts) <= 3
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_cpu_engine_runs_its_experts_through_onednn(model_dirs: dict[str, Path]) -> None:
    """The loader packs the routed experts where it packs the dense projections (float32 on a
    CPU); with the torch backend they stay stacked."""
    model_dir = model_dirs["MixtralForCausalLM"]
    config = load_model_config(model_dir)
    for backend, packed in (("onednn", True), ("torch", False)):
        if backend == "onednn" and not onednn_supports(CPU, torch.float32):
            continue
        model = load_model(model_dir, config, torch.float32, CPU, linear_backend=backend)
        experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        assert experts and all(bool(e.packed_gate_up) is packed for e in experts), backend
        assert all((e.gate_up_proj.numel() == 0) is packed for e in experts), backend


def test_routing_takes_the_top_k_of_the_softmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = route(logits, _softmax_top_k(4, 2, normalize=False))
    probs = torch.softmax(logits, dim=-1)[0]
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    renormalised, _ = route(logits, _softmax_top_k(4, 2, normalize=True))
    torch.testing.assert_close(renormalised[0], probs[[1, 2]] / probs[[1, 2]].sum())


def test_mixtral_loads_its_published_tensor_names(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["MixtralForCausalLM"]
    names = set(load_file(model_dir / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    config = load_model_config(model_dir)
    model = load_model(model_dir, config, torch.float32, CPU)
    tensors = load_file(model_dir / "model.safetensors")
    experts = model.model.layers[1].mlp.experts
    gate_up = torch.cat(
        [tensors[f"model.layers.1.block_sparse_moe.experts.2.{w}.weight"] for w in ("w1", "w3")]
    )
    assert torch.equal(experts.gate_up_proj[2], gate_up)
    assert torch.equal(
        experts.down_proj[2], tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    )


def test_a_missing_expert_tensor_is_named(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    source = model_dirs["Qwen3MoeForCausalLM"]
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.1.mlp.experts.5.up_proj"
    ):
        load_model(tmp_path, load_model_config(tmp_path), torch.float32, CPU)


def test_a_model_whose_layers_are_all_dense_but_one_matches_transformers(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE with its sparse layer last, top-2 of 4 unnormalised, 4 query heads per KV
    head and a head_dim of 32."""
    model_dir = make_tiny_model(
        tmp_path,
        "Qwen3MoeForCausalLM",
        seed=11,
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=False,
        decoder_sparse_step=3,
    )
    config = load_model_config(model_dir)
    assert config.moe is not None and config.moe.sparse_layers == (2,)
    prompts = make_prompts(seed=4)[:4]
    llm = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12)


@pytest.mark.parametrize("linear_backend", ["torch", "onednn"])
def test_every_routed_token_is_counted_once_per_sparse_layer(
    model_dirs: dict[str, Path], linear_backend: str
) -> None:
    """Counted per expert, padding rows (the oneDNN backend pads a step's rows) not counted."""
    model_dir = model_dirs["Qwen2MoeForCausalLM"]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        linear_backend=linear_backend,
    )
    prompts = make_prompts(seed=6)[:5]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    counters = llm.engine.counters()
    moe = llm.engine.model_config.moe
    assert moe is not None and moe.sparse_layers == (0, 2)
    # every prompt token once, and each output token but the last fed back once
    tokens = sum(len(p) for p in prompts) + len(prompts) * 6
    assert sum(counters.expert_tokens) == tokens * 2 * len(moe.sparse_layers)  # top-2
    assert len(counters.expert_tokens) == 8
    assert [layer for layer, _ in counters.expert_layer_imbalance] == [0, 2]
    assert all(1.0 <= ratio <= 8.0 for _, ratio in counters.expert_layer_imbalance)


def test_layer_imbalance_is_the_busiest_expert_over_the_mean() -> None:
    moe = MoeConfig(4, 1, 8, True, (1, 3), 0)
    counts = ExpertTokenCounts(moe)
    assert counts.layer_imbalance() == ((1, 0.0), (3, 0.0))
    counts.add(1, [4, 0, 0, 0])
    counts.add(3, [1, 1, 1, 1])
    counts.add(3, [0, 2, 0, 0])
    assert counts.per_expert() == (5, 3, 1, 1)
    assert counts.layer_imbalance() == ((1, 4.0), (3, 2.0))  # 3 of a mean of 1.5


def test_a_dense_model_reports_no_experts(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    counters = llm.engine.counters()
    assert counters.expert_tokens == () and counters.expert_layer_imbalance == ()


def test_the_config_json_of_a_moe_checkpoint_round_trips(model_dirs: dict[str, Path]) -> None:
    raw = json.loads((model_dirs["Qwen2MoeForCausalLM"] / "config.json").read_text())
    config = load_model_config(model_dirs["Qwen2MoeForCausalLM"])
    assert config.moe is not None
    assert config.moe.num_experts == raw["num_experts"] == 8
    assert config.moe.sparse_layers == (0, 2)  # mlp_only_layers [1]


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_the_expert_count_goes_by_either_name(architecture: str, key: str) -> None:
    moe = parse_model_config(_raw(architecture, **{key: 5, "num_experts_per_tok": 2})).moe
    assert moe is not None and moe.num_experts == 5


def test_mixtral_rope_base_and_norm_epsilon_default_to_transformers_ones() -> None:
    assert parse_model_config(_raw("MixtralForCausalLM")).rope.theta == 1e6
    assert parse_model_config(_raw("MixtralForCausalLM")).rms_norm_eps == 1e-5
    assert parse_model_config(_raw("MixtralForCausalLM", rope_theta=5e5)).rope.theta == 5e5
    assert parse_model_config(_raw("Qwen3MoeForCausalLM")).rope.theta == 10000.0
