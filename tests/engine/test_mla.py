"""DeepSeek-V2/V3: their configs, the latent KV cache, yarn rope and DeepSeek's routers, each
against transformers.

Greedy identity with transformers in every engine mode (batched, chunked prefill, prefix cache
hits, preemption, asynchronous scheduling, tensor parallelism) is in the suites that run every
architecture of ``tests.conftest.ARCHITECTURES``, these two included; the hand-off of the latent
cache between workers in tests/workers/test_local_pd.py.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from engine.kv_cache.budget import KVLayout
from engine.model_config import load_model_config, parse_model_config
from engine.model_loader import load_model
from engine.models.moe import Router
from engine.models.rope import RotaryEmbedding
from tests.engine.hf_reference import hf_model
from tests.engine.paged_runner import PagedRunner
from tests.engine.test_models import _assert_matches_hf
from tests.fixtures.tiny_models import tiny_hf_config

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
CPU = torch.device("cpu")


def _raw(architecture: str, **overrides: Any) -> dict[str, Any]:
    """The tiny config of ``architecture`` as config.json holds it."""
    return {**tiny_hf_config(architecture).to_dict(), **overrides}


def test_v3_config_reads_latent_attention_and_its_router() -> None:
    config = parse_model_config(_raw(V3))
    mla, moe = config.mla, config.moe
    assert mla is not None and moe is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim) == (32, 32, 16)
    assert (mla.qk_rope_head_dim, mla.v_head_dim, mla.rope_interleaved) == (8, 16, True)
    # yarn's mscale (all dims) corrects the softmax scale twice over
    mscale = 0.1 * math.log(4.0) + 1.0
    assert mla.softmax_scale == pytest.approx(24**-0.5 * mscale * mscale)
    # the cache: one entry per token, the latent then the rope key, one plane per layer
    assert (config.num_kv_heads, config.head_dim, config.kv_planes, config.rope_dim) == (
        1,
        40,
        1,
        8,
    )
    assert config.rope.scaling_type == "yarn" and config.rope.factor == 4.0
    assert config.rope.attention_factor == 1.0  # mscale over mscale_all_dim, both 1
    assert (moe.scoring, moe.num_groups, moe.top_groups, moe.group_score) == (
        "sigmoid",
        4,
        2,
        "top2_sum",
    )
    assert moe.score_correction_bias and moe.router_in_float32 and moe.normalize_top_k
    assert moe.routed_scaling_factor == 2.5 and not moe.shared_expert_gated
    assert moe.sparse_layers == (1,)  # first_k_dense_replace 1
    assert moe.shared_expert_intermediate_size == 32  # n_shared_experts x moe_intermediate_size


def test_v2_config_reads_one_query_projection_and_group_limited_softmax() -> None:
    config = parse_model_config(_raw(V2))
    mla, moe = config.mla, config.moe
    assert mla is not None and moe is not None
    assert mla.q_lora_rank is None and mla.softmax_scale == pytest.approx(24**-0.5)
    assert (moe.scoring, moe.num_groups, moe.top_groups, moe.group_score) == (
        "softmax",
        4,
        2,
        "max",
    )
    assert not moe.score_correction_bias and not moe.normalize_top_k
    assert moe.routed_scaling_factor == 1.5
    assert moe.shared_expert_intermediate_size == 64  # two shared experts of 32


@pytest.mark.parametrize(
    ("architecture", "overrides", "message"),
    [
        (V3, {"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
        (V3, {"topk_group": 5}, r"topk_group 5 must be in 1 \.\. 4"),
        (V3, {"num_experts_per_tok": 9}, r"num_experts_per_tok 9 must be in 1 \.\. 8"),
        (V3, {"topk_method": "greedy"}, "DeepSeek-V3 routes with 'noaux_tc' only"),
        (V2, {"topk_method": "random"}, "unsupported topk_method 'random'"),
        (V3, {"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
        (V3, {"kv_lora_rank": 0}, "kv_lora_rank 0 must be at least 1"),
        (V3, {"moe_layer_freq": 0}, "moe_layer_freq 0 must be at least 1"),
        (V2, {"attention_bias": True}, "attention_bias"),
        (V3, {"n_group": 8}, "noaux_tc scores a group by its best two experts"),
    ],
)
def test_bad_deepseek_configs_are_refused_naming_the_field(
    architecture: str, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_config(_raw(architecture, **overrides))


@pytest.mark.parametrize("architecture", [V2, V3])
def test_rope_tables_equal_transformers(architecture: str) -> None:
    """Yarn's frequencies and cos/sin scale (V3's tiny config), plain rope (V2's)."""
    hf_config = tiny_hf_config(architecture)
    config = parse_model_config(hf_config.to_dict())
    ours = RotaryEmbedding(config.rope_dim, config.max_position_embeddings, config.rope)
    positions = torch.arange(config.max_position_embeddings)
    cos, sin = ours(positions, torch.float32)  # [positions, 1, rope_dim // 2]
    if architecture == V3:
        reference = hf_v3.DeepseekV3RotaryEmbedding(hf_config)
        hf_cos, hf_sin = reference(torch.zeros(1), positions[None])  # [1, positions, rope_dim]
        half = config.rope_dim // 2
        torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], atol=0, rtol=0)
        torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], atol=0, rtol=0)
    else:  # V2 keeps its angles as complex numbers
        freqs = hf_v2.DeepseekV2RotaryEmbedding(hf_config)(torch.zeros(1), positions[None])[0]
        torch.testing.assert_close(cos[:, 0], freqs.real, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:, 0], freqs.imag, atol=1e-6, rtol=0)


@pytest.mark.parametrize("architecture", [V2, V3])
def test_routers_pick_and_weigh_the_experts_transformers_does(architecture: str) -> None:
    hf_config = tiny_hf_config(architecture)
    config = parse_model_config(hf_config.to_dict())
    assert config.moe is not None
    torch.manual_seed(0)
    if architecture == V3:
        reference: torch.nn.Module = hf_v3.DeepseekV3TopkRouter(hf_config)
    else:
        reference = hf_v2.DeepseekV2TopkRouter(hf_config)
    ours = Router(config.moe, config.hidden_size)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.5)
        ours.weight.copy_(reference.weight)
        if architecture == V3:
            reference.e_score_correction_bias.normal_(0.0, 0.2)
            assert ours.e_score_correction_bias is not None
            ours.e_score_correction_bias.copy_(reference.e_score_correction_bias)
        x = torch.randn(200, config.hidden_size)
        _, hf_weights, hf_ids = reference(x)
        weights, ids = ours(x)
    # the same experts and weights per token, whatever the order topk returns them in
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6, rtol=0
    )
    # the groups limit the choice: without them some tokens would take other experts
    logits = x @ reference.weight.T
    scores = logits.sigmoid() if architecture == V3 else logits.softmax(dim=-1)
    ungrouped = scores.topk(config.moe.num_experts_per_token, dim=-1)[1].sort(dim=-1)[0]
    assert not torch.equal(ungrouped, ids.sort(dim=-1)[0])


def test_latent_cache_holds_what_transformers_caches(model_dirs: dict[str, Path]) -> None:
    """One entry per token and layer: the normed latent, then the rotated key part, in the
    order transformers' DeepSeek-V3 caches them (its interleaved rope outputs halves)."""
    model_dir = model_dirs[V3]
    config = load_model_config(model_dir)
    runner = PagedRunner(load_model(model_dir, config, torch.float32, CPU), config)
    tokens = list(range(5, 45))
    seq = runner.new_seq(tokens)
    runner.step([(seq, len(tokens))])
    _assert_matches_hf(model_dir, [seq])
    assert runner.kv_cache.shape[1:] == (1, 256, 4, 1, 40)  # one plane, one head, 32 + 8 wide
    with torch.no_grad():
        cache = hf_model(model_dir)(torch.tensor([tokens]), use_cache=True).past_key_values
    blocks = torch.tensor(seq.block_ids[0])
    for layer in range(config.num_layers):
        ours = runner.kv_cache[layer, 0, blocks, :, 0].reshape(-1, 40)[: len(tokens)]
        latent, rope_key = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
        torch.testing.assert_close(ours, torch.cat((latent, rope_key), dim=-1), atol=1e-5, rtol=0)


def test_a_latent_cache_is_a_fraction_of_a_multi_head_one() -> None:
    """What a block costs in memory and on the wire: DeepSeek-V3's published sizes cache 576
    elements per token and layer, where its 128 heads' K and V would be 128 x 2 x 192."""
    published = tiny_hf_config(
        V3,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        head_dim=64,
        num_key_value_heads=128,
    )
    config = parse_model_config(published.to_dict())
    latent = KVLayout(config.num_layers, 1, config.head_dim, 16, torch.bfloat16, kv_planes=1)
    heads = KVLayout(config.num_layers, 128, 192, 16, torch.bfloat16)
    assert (config.head_dim, config.kv_planes) == (576, 1)
    assert latent.bytes_per_block == config.num_layers * 16 * 576 * 2
    assert heads.bytes_per_block / latent.bytes_per_block == pytest.approx(128 * 2 * 192 / 576)


@pytest.mark.parametrize("architecture", [V3, "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM"])
def test_the_multi_token_prediction_layer_is_skipped_at_load(
    model_dirs: dict[str, Path], tmp_path: Path, architecture: str
) -> None:
    """DeepSeek-V3, GLM-4.5 and MiniMax-M2 publish layers past num_hidden_layers for
    speculative decoding; they are not part of the model transformers runs, and load as nothing
    (other tensors of no layer of the model are still refused)."""
    source = model_dirs[architecture]
    shutil.copytree(source, tmp_path / "mtp")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.enorm.weight"] = torch.ones(64)
    save_file(tensors, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    config = load_model_config(tmp_path / "mtp")
    with_mtp = load_model(tmp_path / "mtp", config, torch.float32, CPU)
    without = load_model(source, config, torch.float32, CPU)
    for (name, ours), (_, theirs) in zip(
        with_mtp.named_parameters(), without.named_parameters(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(4)
    save_file(tensors, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensors.*self_attn.extra"):
        load_model(tmp_path / "mtp", config, torch.float32, CPU)
