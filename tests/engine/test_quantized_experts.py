"""Quantized mixture-of-experts checkpoints: compressed-tensors' pack-quantized W4A16 / W8A16
(made by compressed-tensors itself, tests/fixtures/quantized_moe_models.py), block-wise FP8
(Qwen3-MoE's and DeepSeek-V3's release layout) and AWQ, their experts kept quantized in memory
(engine/quantization/quantized_experts.py) and run to the same greedy tokens as transformers.

The references: transformers on the same checkpoint where it runs it on CPU (symmetric
pack-quantized experts, FP8 blocks: it dequantizes both at load); for asymmetric experts (its
expert loader drops their zero points in 5.23 and fails) and AWQ (no CPU kernel installs here),
transformers on the float checkpoint the quantized one decompresses into (compressed-tensors'
own decompression; the AWQ fixture's integers). Tensor parallelism, and the refusals, named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from engine.kernels import fp8_block_matmul, packed_int_matmul
from engine.kernels.linear import PackedLinear
from engine.model_config import parse_model_config
from engine.models.mla import UpProjection
from engine.models.moe import QuantizedRoutedExperts, route
from engine.moe_config import MoeConfig
from engine.quantization.config import Fp8BlockWeights, PackedIntWeights
from engine.quantization.fp8_linear import Fp8BlockLinear
from engine.quantization.packed_linear import PackedIntLinear, pack_int32
from engine.quantization.quantized_experts import Fp8BlockExpertWeights, PackedIntExpertWeights
from engine.quantization.router_gates import gates_named, names_router_gates
from tests.engine.quantized_runs import engine_greedy, quantized_llm, transformers_greedy
from tests.fixtures.awq_gptq_models import make_awq_model
from tests.fixtures.quantized_models import make_fp8_block_model
from tests.fixtures.quantized_moe_models import (
    DEEPSEEK_V3,
    MIXTRAL,
    QUANTIZABLE_MOE,
    QWEN2_MOE,
    QWEN3_MOE,
    make_pack_quantized_moe_model,
    quantization_config_of,
)
from tests.fixtures.tiny_models import tiny_hf_config

TP_OPTIONS: dict[str, Any] = {"tensor_parallel_size": 2, "tensor_parallel_timeout_s": 60.0}
GLM_4_5 = "Glm4MoeForCausalLM"
# DeepSeek-V3's tiny sizes (tests/fixtures/tiny_models.py) with blocks of 8: every projection's
# rows and columns (40 of the latent and rope key, 24 a query head) fall on whole blocks
DEEPSEEK_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_key_value_heads": 4,
    "head_dim": 8,
}


def _transformers_greedy(model_dir: Path, **options: Any) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **options)
    return transformers_greedy(model.eval())


def _dequantizing_transformers_greedy(model_dir: Path) -> list[list[int]]:
    """transformers on a compressed-tensors checkpoint, decompressed at load."""
    dequantize = CompressedTensorsConfig(dequantize=True)
    return _transformers_greedy(model_dir, quantization_config=dequantize)


def _experts(llm: Any) -> list[QuantizedRoutedExperts]:
    return [m for m in llm.engine.model.modules() if isinstance(m, QuantizedRoutedExperts)]


@pytest.fixture(scope="module")
def w4_sym_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pack_quantized_moe_model(tmp_path_factory.mktemp("w4-sym"), symmetric=True)


@pytest.fixture(scope="module")
def w4_asym_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pack_quantized_moe_model(tmp_path_factory.mktemp("w4-asym"), symmetric=False)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE in its FP8 release's layout: blocks of 128, the LM head and every sparse
    layer's router gate named unconverted."""
    gates = [f"model.layers.{layer}.mlp.gate" for layer in (1,)]
    return make_fp8_block_model(
        tmp_path_factory.mktemp("fp8"),
        architecture=QWEN3_MOE,
        modules_to_not_convert=["lm_head", *gates],
        **QUANTIZABLE_MOE[QWEN3_MOE],
    )


def test_w4a16_experts_stay_packed_and_equal_transformers(w4_sym_dir: Path) -> None:
    assert quantization_config_of(w4_sym_dir)["ignore"] == ["lm_head", "model.layers.1.mlp.gate"]
    llm = quantized_llm(w4_sym_dir)
    (experts,) = _experts(llm)  # layer 0 is dense
    assert isinstance(experts.gate_up_proj, PackedIntExpertWeights)
    assert experts.gate_up_proj.weight_packed.shape == (6, 256, 16)  # 6 experts, gate and up
    assert experts.down_proj.weight_packed.dtype == torch.int32
    expected = _dequantizing_transformers_greedy(w4_sym_dir)
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(w4_sym_dir.parent / "float")) != expected  # not a no-op


def test_asymmetric_experts_dequantize_exactly_and_equal_the_decompressed_model(
    w4_asym_dir: Path,
) -> None:
    """Each expert's weights, zero points included, are what compressed-tensors decompresses
    the checkpoint into, bit for bit; greedy tokens are transformers' on those weights."""
    llm = quantized_llm(w4_asym_dir)
    (experts,) = _experts(llm)
    decompressed = w4_asym_dir.parent / "dequantized"
    expected = load_file(str(decompressed / "model.safetensors"))
    assert isinstance(experts.down_proj, PackedIntExpertWeights)
    assert experts.down_proj.weight_zero_point is not None
    prefix = "model.layers.1.mlp.experts"
    for expert in range(6):
        gate_up = torch.cat(
            [expected[f"{prefix}.{expert}.{part}_proj.weight"] for part in ("gate", "up")]
        )
        assert torch.equal(experts.gate_up_proj.dequantized(expert), gate_up)
        down = expected[f"{prefix}.{expert}.down_proj.weight"]
        assert torch.equal(experts.down_proj.dequantized(expert), down)
    assert engine_greedy(llm) == _transformers_greedy(decompressed)


def test_two_tensor_parallel_ranks_split_the_experts_at_whole_groups_and_words(
    w4_asym_dir: Path,
) -> None:
    """Each rank holds 64 of every expert's 128 columns: gate and up rows (their zero points
    in words of 8 rows), down's inputs in groups of 32."""
    llm = quantized_llm(w4_asym_dir, **TP_OPTIONS)
    try:
        assert engine_greedy(llm) == engine_greedy(quantized_llm(w4_asym_dir))
    finally:
        llm.close()


def test_fp8_block_experts_stay_float8_and_equal_transformers(fp8_dir: Path) -> None:
    llm = quantized_llm(fp8_dir)
    (experts,) = _experts(llm)
    assert isinstance(experts.gate_up_proj, Fp8BlockExpertWeights)
    assert experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj.weight_scale_inv.shape == (6, 2, 1)  # 256 x 128 in blocks
    theirs = AutoModelForCausalLM.from_pretrained(str(fp8_dir), dtype=torch.float32)
    stacked = theirs.model.layers[1].mlp.experts  # dequantized by transformers at load
    for expert in range(6):
        assert torch.equal(experts.gate_up_proj.dequantized(expert), stacked.gate_up_proj[expert])
        assert torch.equal(experts.down_proj.dequantized(expert), stacked.down_proj[expert])
    expected = transformers_greedy(theirs.eval())
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(fp8_dir.parent / "float")) != expected


def _expert_bytes(llm: Any) -> int:
    """The experts' weight bytes: their parameters, and on a CPU with oneDNN the float experts'
    projections packed for it (their stacked parameters given up)."""
    model = llm.engine.model
    params = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name
    )
    packed = sum(
        m.packed_weight.numel() * m.packed_weight.element_size()
        for name, m in model.named_modules()
        if ".experts." in name and isinstance(m, PackedLinear)
    )
    return params + packed


def test_expert_weights_keep_their_quantized_bytes(w4_sym_dir: Path, fp8_dir: Path) -> None:
    options: dict[str, Any] = {"dtype": "bfloat16"}
    for model_dir, low, high in ((w4_sym_dir, 0.28, 0.29), (fp8_dir, 0.5, 0.501)):
        quantized = _expert_bytes(quantized_llm(model_dir, **options))
        ratio = quantized / _expert_bytes(quantized_llm(model_dir.parent / "float", **options))
        # 4 of 16 bits and a bfloat16 scale per 32 (0.28125); 8 bits and a float32 per 128 x 128
        assert low < ratio < high, (model_dir, ratio)


def _top_k_of(num_experts: int, top_k: int) -> MoeConfig:
    """A router's config: the top k of a softmax, renormalised."""
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=16,
        normalize_top_k=True,
        sparse_layers=(0,),
        shared_expert_intermediate_size=0,
    )


def _random_packed_experts(num_experts: int, hidden: int, width: int) -> QuantizedRoutedExperts:
    weights = PackedIntWeights(4, 16, symmetric=False)
    experts = QuantizedRoutedExperts(num_experts, hidden, width, weights)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for projection in (experts.gate_up_proj, experts.down_proj):
            assert isinstance(projection, PackedIntExpertWeights)
            for expert in range(num_experts):
                rows, words = projection.weight_packed.shape[1:]
                values = torch.randint(0, 16, (rows, words * 8), generator=generator)
                projection.weight_packed[expert] = pack_int32(values, 4)
                assert projection.weight_zero_point is not None
                zeros = torch.randint(0, 16, (rows, projection.weight_scale.shape[2]))
                projection.weight_zero_point[expert] = pack_int32(zeros.t(), 4).t()
            projection.weight_scale.uniform_(0.01, 0.05, generator=generator)
    return experts


def test_only_experts_with_tokens_are_dequantized_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    experts = _random_packed_experts(num_experts=6, hidden=32, width=16)
    dequantized: list[tuple[str, int]] = []
    for name in ("gate_up_proj", "down_proj"):
        projection = getattr(experts, name)
        original = projection.dequantized

        def record(expert: int, name: str = name, original: Any = original) -> torch.Tensor:
            dequantized.append((name, expert))
            return original(expert)

        monkeypatch.setattr(projection, "dequantized", record)
    x = torch.randn(5, 32)
    logits = torch.full((5, 6), -10.0)
    logits[:, 1], logits[:3, 4], logits[3:, 2] = 5.0, 4.0, 4.0  # experts 1, 2 and 4 only
    moe_weights, ids = route(logits, _top_k_of(num_experts=6, top_k=2))
    out, counts = experts(x, moe_weights, ids)
    assert counts == [0, 5, 2, 0, 3, 0]
    assert dequantized == [(name, e) for e in (1, 2, 4) for name in ("gate_up_proj", "down_proj")]
    assert out.shape == (5, 32)


def _random_fp8_experts(num_experts: int, hidden: int, width: int) -> QuantizedRoutedExperts:
    experts = QuantizedRoutedExperts(num_experts, hidden, width, Fp8BlockWeights(32, 32))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for projection in (experts.gate_up_proj, experts.down_proj):
            assert isinstance(projection, Fp8BlockExpertWeights)
            projection.keep_quantized_dtypes()
            drawn = torch.randn(projection.weight.shape, generator=generator)
            projection.weight.copy_(drawn.to(torch.float8_e4m3fn))
            projection.weight_scale_inv.uniform_(0.01, 0.05, generator=generator)
    return experts


@pytest.mark.parametrize("kind", ["packed", "fp8"])
def test_the_gpu_path_runs_the_dense_kernels_per_expert(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dense layers' kernels (Triton's interpreter here) on each expert's slice: the packed
    one computes the dequantizing path's numbers; the FP8 one also quantizes the activations
    per token group, as DeepSeek-V3's kernels do, so it is within that rounding of them."""
    make = _random_packed_experts if kind == "packed" else _random_fp8_experts
    experts = make(num_experts=4, hidden=64, width=32)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    moe_weights, ids = route(logits, _top_k_of(num_experts=4, top_k=2))
    expected, _ = experts(x, moe_weights, ids)
    if kind == "packed":
        monkeypatch.setattr(packed_int_matmul, "usable", lambda x: True)
    else:
        monkeypatch.setattr(fp8_block_matmul, "usable", lambda x, block_size: True)
    got, _ = experts(x, moe_weights, ids)
    if kind == "packed":
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert float((got - expected).abs().max()) < 0.05 * float(expected.abs().max())


def test_qwen2_moe_shared_expert_is_a_packed_layer_and_its_gate_stays_float(
    tmp_path: Path,
) -> None:
    model_dir = make_pack_quantized_moe_model(tmp_path, architecture=QWEN2_MOE, symmetric=True)
    llm = quantized_llm(model_dir)
    block = llm.engine.model.model.layers[0].mlp
    assert block.shared_expert is not None
    assert isinstance(block.shared_expert.gate_up_proj, PackedIntLinear)
    assert not isinstance(block.shared_expert_gate, PackedIntLinear)  # float (onednn-packed)
    assert engine_greedy(llm) == _dequantizing_transformers_greedy(model_dir)


def test_mixtral_w8a16_experts_equal_transformers(tmp_path: Path) -> None:
    """Mixtral's w1, w3, w2 experts, 8 bits per channel."""
    model_dir = make_pack_quantized_moe_model(
        tmp_path, architecture=MIXTRAL, num_bits=8, group_size=None
    )
    llm = quantized_llm(model_dir)
    assert len(_experts(llm)) == 2
    assert engine_greedy(llm) == _dequantizing_transformers_greedy(model_dir)


def test_awq_experts_equal_transformers_on_their_float_weights(tmp_path: Path) -> None:
    """AutoAWQ's layout: each expert's layers converted into the packed layout as loaded."""
    model_dir = make_awq_model(
        tmp_path, architecture=QWEN3_MOE, **QUANTIZABLE_MOE[QWEN3_MOE], num_hidden_layers=2
    )
    llm = quantized_llm(model_dir)
    (experts,) = _experts(llm)
    assert isinstance(experts.down_proj, PackedIntExpertWeights)
    assert engine_greedy(llm) == _transformers_greedy(tmp_path / "dequantized")


@pytest.fixture(scope="module")
def deepseek_fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deepseek-fp8")
    return make_fp8_block_model(root, architecture=DEEPSEEK_V3, block=(8, 8), **DEEPSEEK_SIZES)


def test_deepseek_v3_in_fp8_blocks_equals_transformers(deepseek_fp8_dir: Path) -> None:
    """Latent attention's projections in FP8 blocks (kv_b_proj dequantized at load for the
    absorption, the rope dims gathered into halves), a dense first layer, routed and shared
    experts."""
    llm = quantized_llm(deepseek_fp8_dir)
    attention = llm.engine.model.model.layers[1].self_attn
    assert isinstance(attention.q_b_proj, Fp8BlockLinear)
    assert isinstance(attention.kv_a_proj_with_mqa, Fp8BlockLinear)
    assert isinstance(attention.kv_b_proj, UpProjection)
    assert attention.kv_b_proj.weight.dtype == torch.float32
    assert attention.rope_order is not None
    assert isinstance(llm.engine.model.model.layers[1].mlp.shared_expert.down_proj, Fp8BlockLinear)
    assert len(_experts(llm)) == 1
    expected = _transformers_greedy(deepseek_fp8_dir)
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(deepseek_fp8_dir.parent / "float")) != expected


@pytest.mark.parametrize(
    ("architecture", "expert_width"), [(GLM_4_5, 128), ("MiniMaxM2ForCausalLM", 48)]
)
def test_glm_and_minimax_in_fp8_blocks_equal_transformers(
    tmp_path: Path, architecture: str, expert_width: int
) -> None:
    """GLM-4.5-FP8's and MiniMax-M2's layouts: q/k/v in FP8 blocks (GLM's biases float; before
    MiniMax's norms over all heads), the routed experts (and GLM's shared one) in blocks, the
    router gates float."""
    sizes = {"hidden_size": 64, "intermediate_size": expert_width, "head_dim": 16}
    model_dir = make_fp8_block_model(tmp_path, architecture=architecture, block=(8, 8), **sizes)
    llm = quantized_llm(model_dir)
    attention = llm.engine.model.model.layers[1].self_attn
    assert isinstance(attention.qkv_proj, Fp8BlockLinear)
    assert (attention.qkv_proj.bias is not None) == (architecture == GLM_4_5)
    assert len(_experts(llm)) == (1 if architecture == GLM_4_5 else 2)
    expected = _transformers_greedy(model_dir)
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(tmp_path / "float")) != expected


def test_deepseek_v3_in_fp8_blocks_on_two_tensor_parallel_ranks(deepseek_fp8_dir: Path) -> None:
    """Each rank: two query heads' rows of q_b_proj and kv_b_proj, their columns of o_proj,
    half of every expert's and the shared experts' columns; blocks of 8 stay whole."""
    llm = quantized_llm(deepseek_fp8_dir, **TP_OPTIONS)
    try:
        assert engine_greedy(llm) == engine_greedy(quantized_llm(deepseek_fp8_dir))
    finally:
        llm.close()


def test_deepseek_v3_in_asymmetric_w4a16_equals_the_decompressed_model(tmp_path: Path) -> None:
    """llm-compressor's W4A16 of DeepSeek-V3: latent attention's projections packed too
    (kv_b_proj, zero points included, dequantized at load)."""
    model_dir = make_pack_quantized_moe_model(
        tmp_path, architecture=DEEPSEEK_V3, symmetric=False, **DEEPSEEK_SIZES
    )
    llm = quantized_llm(model_dir)
    attention = llm.engine.model.model.layers[1].self_attn
    assert isinstance(attention.kv_a_proj_with_mqa, PackedIntLinear)
    assert isinstance(attention.kv_b_proj, UpProjection)
    assert engine_greedy(llm) == _transformers_greedy(tmp_path / "dequantized")


def test_a_tensor_parallel_slice_that_cuts_an_experts_block_is_refused(tmp_path: Path) -> None:
    """Blocks of 64 and experts 64 wide: each rank's 32 columns cut a block (the attention's
    and the dense layer's halves do not)."""
    overrides = {**QUANTIZABLE_MOE[QWEN3_MOE], "moe_intermediate_size": 64}
    model_dir = make_fp8_block_model(tmp_path, architecture=QWEN3_MOE, block=(64, 64), **overrides)
    with pytest.raises(ValueError, match=r"0\.\.32 of 64 .* blocks of 64 .*weight_block_size"):
        quantized_llm(model_dir, **TP_OPTIONS)


def test_expert_parallel_ranks_hold_whole_experts_where_a_slice_would_cut_a_block(
    tmp_path: Path,
) -> None:
    """The checkpoint above, refused with its experts split by columns, serves with them dealt
    out whole: each rank holds three of the six experts, every block of each, in float8."""
    overrides = {**QUANTIZABLE_MOE[QWEN3_MOE], "moe_intermediate_size": 64}
    model_dir = make_fp8_block_model(tmp_path, architecture=QWEN3_MOE, block=(64, 64), **overrides)
    llm = quantized_llm(model_dir, **TP_OPTIONS, enable_expert_parallel=True)
    try:
        (experts,) = _experts(llm)
        assert experts.held == range(0, 3)
        assert isinstance(experts.gate_up_proj, Fp8BlockExpertWeights)
        assert experts.gate_up_proj.weight.shape == (3, 128, 128)  # gate and up rows of 64
        assert experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert engine_greedy(llm) == _transformers_greedy(model_dir)
    finally:
        llm.close()


def test_expert_parallel_ranks_of_packed_experts_equal_the_decompressed_model(
    w4_asym_dir: Path,
) -> None:
    llm = quantized_llm(w4_asym_dir, **TP_OPTIONS, enable_expert_parallel=True)
    try:
        (experts,) = _experts(llm)
        assert isinstance(experts.gate_up_proj, PackedIntExpertWeights)
        assert experts.gate_up_proj.weight_packed.shape == (3, 256, 16)  # every column of 3
        assert engine_greedy(llm) == _transformers_greedy(w4_asym_dir.parent / "dequantized")
    finally:
        llm.close()


def test_dummy_weights_build_quantized_experts_from_the_config_alone(w4_asym_dir: Path) -> None:
    llm = quantized_llm(w4_asym_dir, load_format="dummy")
    assert len(_experts(llm)) == 1
    assert len(engine_greedy(llm)) == 4


def _moe_raw(architecture: str, quantization: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    raw = tiny_hf_config(architecture).to_dict()
    return {**raw, **overrides, "quantization_config": quantization}


def _pack_quantized(ignore: list[str], **weights: Any) -> dict[str, Any]:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {**args, "group_size": 32, **weights}}
        },
        "ignore": ignore,
    }


@pytest.mark.parametrize(
    ("architecture", "ignore"),
    [
        (QWEN3_MOE, ["lm_head", "re:.*mlp.gate$"]),
        (QWEN3_MOE, ["lm_head", "model.layers.1.mlp.gate"]),
        (MIXTRAL, ["lm_head", "re:.*block_sparse_moe.gate"]),
        (QWEN2_MOE, ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]),
        (DEEPSEEK_V3, ["lm_head", "re:.*mlp.gate$"]),
    ],
)
def test_router_gates_left_float_are_accepted(architecture: str, ignore: list[str]) -> None:
    config = parse_model_config(_moe_raw(architecture, _pack_quantized(ignore)))
    assert config.quantization == PackedIntWeights(4, 32, True)


def test_fp8_and_awq_lists_of_unconverted_modules_may_name_the_gates() -> None:
    fp8 = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.gate"],
    }
    assert parse_model_config(_moe_raw(QWEN3_MOE, fp8)).quantization == Fp8BlockWeights(128, 128)
    with pytest.raises(ValueError, match="quantization_config.modules_to_not_convert"):
        parse_model_config(_moe_raw("LlamaForCausalLM", fp8))  # no router to leave float
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["gate"]}
    assert parse_model_config(_moe_raw(MIXTRAL, awq)).quantization is not None


@pytest.mark.parametrize(
    ("architecture", "quantization", "message"),
    [
        (  # a quantized router: compressed-tensors quantizes every Linear ignore leaves
            QWEN3_MOE,
            _pack_quantized(["lm_head"]),
            r"not supported for Qwen3MoeForCausalLM with quantization_config\.ignore",
        ),
        (
            QWEN2_MOE,
            _pack_quantized(["lm_head", "re:.*mlp.gate$"]),
            "shared_expert_gate layers stay float",
        ),
        (  # names the dense MLP's gate_proj too
            QWEN3_MOE,
            _pack_quantized(["lm_head", "re:.*mlp.gate"]),
            r"quantization_config\.ignore",
        ),
        (
            QWEN3_MOE,
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
                        "input_activations": {
                            "type": "int",
                            "num_bits": 8,
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                },
                "ignore": ["lm_head", "re:.*mlp.gate$"],
            },
            "hold FP8 block-wise or packed integer weights",
        ),
        (
            MIXTRAL,
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
            r"quantization_config\.desc_act true",
        ),
        (
            "GptOssForCausalLM",
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            "clamped-SwiGLU experts run float or MXFP4 weights only",
        ),
    ],
    ids=["router-quantized", "shared-gate", "gate-proj-too", "w8a8", "gptq-act-order", "gpt-oss"],
)
def test_what_experts_cannot_hold_is_refused_naming_the_field(
    architecture: str, quantization: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_config(_moe_raw(architecture, quantization))


@pytest.mark.parametrize(
    ("entry", "gates"),
    [
        ("re:.*mlp.gate$", {"gate"}),
        ("re:.*block_sparse_moe.gate", {"gate"}),
        ("re:.*mlp.shared_expert_gate$", {"shared_expert_gate"}),
        ("re:.*gate$", {"gate", "shared_expert_gate"}),
        ("model.layers.7.mlp.gate", {"gate"}),
        ("gate", {"gate"}),
        ("re:.*mlp.gate", set()),  # gate_proj too
        ("re:.*mlp.*", set()),
        ("model.layers.7.mlp.gate_proj", set()),
        ("re:(", set()),
    ],
)
def test_entries_name_router_gates_only_when_they_name_no_projection(
    entry: str, gates: set[str]
) -> None:
    assert names_router_gates(entry) == bool(gates)
    assert gates_named([entry]) == gates
