"""gpt-oss as OpenAI publishes it: its routed experts in MXFP4 (``quant_method: mxfp4``), the
rest float. The checkpoints are the tiny float model's experts quantized by
tests/fixtures/mxfp4_models.py; the engine's dequantized experts must be transformers' own
dequantization of the same files bit for bit, and its greedy tokens transformers', on one rank,
on two ranks splitting each expert's columns, and on two ranks holding whole experts."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

from engine.kernels.linear import PackedLinear
from engine.model_config import parse_model_config
from engine.models.moe import Mxfp4ClampedSwigluExperts
from engine.quantization.mxfp4_experts import dequantize_mxfp4, quantize_mxfp4
from tests.engine.quantized_runs import engine_greedy, quantized_llm, transformers_greedy
from tests.fixtures.local_cluster import local_cluster_config
from tests.fixtures.mxfp4_models import make_mxfp4_gpt_oss
from tests.fixtures.tiny_models import tiny_hf_config

TP_OPTIONS: dict[str, Any] = {"tensor_parallel_size": 2, "tensor_parallel_timeout_s": 60.0}


def _transformers(model_dir: Path) -> Any:
    """transformers' gpt-oss on the same files, its experts dequantized at load."""
    config = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, quantization_config=config
    )
    return model.eval()


def _experts(llm: Any) -> list[Mxfp4ClampedSwigluExperts]:
    modules = llm.engine.model.modules()
    return [m for m in modules if isinstance(m, Mxfp4ClampedSwigluExperts)]


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4"), seed=3)


@pytest.fixture(scope="module")
def wide_mxfp4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Experts 64 wide: two ranks hold 32 columns each, one MXFP4 run of down's inputs."""
    return make_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4-wide"), seed=4, intermediate_size=64)


def test_experts_stay_mxfp4_and_equal_transformers_dequantization(mxfp4_dir: Path) -> None:
    llm = quantized_llm(mxfp4_dir)
    theirs = _transformers(mxfp4_dir)
    experts = _experts(llm)
    assert len(experts) == 2  # both layers
    for layer, ours in enumerate(experts):
        assert ours.gate_up_proj_blocks.dtype == torch.uint8
        assert ours.gate_up_proj_blocks.shape == (4, 64, 2, 16)  # 2 x 32 rows, 64 inputs
        assert ours.down_proj_blocks.shape == (4, 64, 1, 16)
        stacked = theirs.model.layers[layer].mlp.experts
        for expert in range(4):
            gate_up, down = ours.dequantized(expert, torch.float32)
            assert torch.equal(gate_up, stacked.gate_up_proj[expert])
            assert torch.equal(down, stacked.down_proj[expert])
        # 4 bits a weight and a scale byte per 32: 17/32 of a byte (float32 takes 4)
        held = sum(
            p.numel() * p.element_size()
            for name, p in ours.named_parameters()
            if name.endswith(("_blocks", "_scales"))
        )
        assert held * 32 == (stacked.gate_up_proj.numel() + stacked.down_proj.numel()) * 17
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, (torch.nn.Linear, PackedLinear))  # the attention stays float
    expected = transformers_greedy(theirs)
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(mxfp4_dir.parent / "float")) != expected  # not a no-op


def test_dequantizing_inverts_quantizing() -> None:
    """Values that are e2m1 numbers times a power of two come back exactly."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    signs = torch.where(torch.rand(3, 5, 64, generator=generator) < 0.5, -1.0, 1.0)
    picks = magnitudes[torch.randint(0, 8, (3, 5, 64), generator=generator)]
    exponents = torch.randint(-20, 4, (3, 5, 2, 1), generator=generator).float()
    weight = (signs * picks).reshape(3, 5, 2, 32) * torch.exp2(exponents)
    weight[..., 0] = 6.0 * torch.exp2(exponents[..., 0])  # each run's largest takes 6
    weight = weight.reshape(3, 5, 64)
    blocks, scales = quantize_mxfp4(weight)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), weight)


def test_two_ranks_split_each_experts_columns_at_whole_runs(wide_mxfp4_dir: Path) -> None:
    llm = quantized_llm(wide_mxfp4_dir, **TP_OPTIONS)
    try:
        (experts, _) = _experts(llm)
        assert experts.down_proj_blocks.shape == (4, 64, 1, 16)  # 32 of 64 inputs: one run
        assert engine_greedy(llm) == transformers_greedy(_transformers(wide_mxfp4_dir))
    finally:
        llm.close()


def test_a_rank_slice_that_cuts_a_run_is_refused_and_expert_parallelism_serves_it(
    mxfp4_dir: Path,
) -> None:
    """Experts 32 wide: two ranks' 16 columns each would cut down's run of 32 inputs."""
    before = set(multiprocessing.active_children())
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size 2 leaves each rank 16 of every "
        "expert's 32 columns: MXFP4 experts split at runs of 32",
    ):
        quantized_llm(mxfp4_dir, **TP_OPTIONS)
    assert set(multiprocessing.active_children()) == before  # refused before any rank starts
    llm = quantized_llm(mxfp4_dir, **TP_OPTIONS, enable_expert_parallel=True)
    try:
        assert [e.held for e in _experts(llm)] == [range(0, 2)] * 2
        assert engine_greedy(llm) == transformers_greedy(_transformers(mxfp4_dir))
    finally:
        llm.close()


def test_dummy_weights_build_mxfp4_experts_from_the_config_alone(mxfp4_dir: Path) -> None:
    llm = quantized_llm(mxfp4_dir, load_format="dummy")
    experts = _experts(llm)
    gate_up, down = experts[0].dequantized(0, torch.float32)
    assert 0 < gate_up.abs().max() <= 6 * 2.0**-8 and down.abs().max() <= 6 * 2.0**-8
    assert all(len(tokens) == 12 for tokens in engine_greedy(llm))


@pytest.mark.parametrize(
    ("architecture", "quantization", "message"),
    [
        (
            "MixtralForCausalLM",
            {"quant_method": "mxfp4"},
            "mxfp4 .* is not supported for MixtralForCausalLM: MXFP4 is read for gpt-oss's",
        ),
        (
            "GptOssForCausalLM",
            {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.experts"]},
            r"modules_to_not_convert names the experts",
        ),
    ],
)
def test_what_mxfp4_cannot_hold_is_refused_naming_the_field(
    architecture: str, quantization: dict[str, Any], message: str
) -> None:
    raw = tiny_hf_config(architecture).to_dict()
    raw["quantization_config"] = quantization
    with pytest.raises(ValueError, match=message):
        parse_model_config(raw)


def test_serve_refuses_the_size_naming_the_flag(mxfp4_dir: Path) -> None:
    with pytest.raises(ValueError, match="--decode-tp 2 leaves each rank 16 of every expert's"):
        local_cluster_config(mxfp4_dir, num_prefill=0, decode_tp=2)
    config = local_cluster_config(mxfp4_dir, num_prefill=0, decode_tp=2, expert_parallel=True)
    assert config.parallel_config("decode").expert_parallel


@pytest.mark.parametrize("path", ["c_kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_byte_and_scale_dequantizes_as_transformers_does(
    path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All 256 bytes under all 256 scale bytes (2^-127 to 2^128: subnormal products, and the
    byte 255's power, which is no float32), in each dtype, on the C kernel and on the torch
    path (a GPU's): the same bits as transformers' ``convert_moe_packed_tensors``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.kernels.cpu import mxfp4 as cpu_mxfp4

    if path == "torch":
        monkeypatch.setattr(cpu_mxfp4, "usable", lambda blocks: False)
    else:
        assert cpu_mxfp4.usable(torch.zeros(1, dtype=torch.uint8))
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    blocks = every_byte.expand(1, 256, 16, 16).contiguous()  # [1 expert, 256 rows, 16 runs]
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16)
    ours = dequantize_mxfp4(blocks, scales.contiguous(), dtype)
    theirs = convert_moe_packed_tensors(blocks, scales.contiguous(), dtype=dtype).transpose(1, 2)
    assert ours.dtype == dtype
    assert torch.equal(
        ours.view(torch.int16 if dtype != torch.float32 else torch.int32),
        theirs.contiguous().view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
