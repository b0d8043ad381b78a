"""Block-wise FP8 checkpoints (``quant_method: fp8``, DeepSeek-V3's and Qwen3's layout): float8
weights with a float32 scale per block, loaded as they are and run to the same greedy tokens
as transformers running the same files (on CPU it dequantizes them, as the engine does); on two
tensor-parallel ranks too. A block a slice would cut, and configs the engine cannot run, are
refused at load naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.quantization.config import Fp8BlockWeights, parse_quantization_config
from engine.quantization.fp8_linear import Fp8BlockLinear
from tests.engine.quantized_runs import (
    PROMPTS,
    engine_greedy,
    projection_bytes,
    quantized_llm,
    transformers_greedy,
)
from tests.fixtures.quantized_models import make_fp8_block_model

FOUR_KV_HEADS = {"num_key_value_heads": 4}  # k and v of 128 rows: whole blocks of 128


def _transformers_greedy(model_dir: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return transformers_greedy(model)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_block_model(tmp_path_factory.mktemp("fp8"), **FOUR_KV_HEADS)


def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(fp8_dir: Path) -> None:
    llm = quantized_llm(fp8_dir)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == 2 * 4
    assert all(layer.weight.dtype == torch.float8_e4m3fn for layer in layers)
    assert all(layer.weight_scale_inv.dtype == torch.float32 for layer in layers)
    expected = _transformers_greedy(fp8_dir)
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(fp8_dir.parent / "float")) != expected  # not a no-op


def test_fp8_weights_take_half_their_bfloat16_bytes(fp8_dir: Path) -> None:
    options: dict[str, Any] = {"dtype": "bfloat16", "linear_backend": "torch"}

    ratio = projection_bytes(quantized_llm(fp8_dir, **options)) / projection_bytes(
        quantized_llm(fp8_dir.parent / "float", **options)
    )
    assert 0.5 < ratio < 0.501  # a byte a weight, and a float32 scale per 128 x 128


def test_two_tensor_parallel_ranks_equal_transformers(tmp_path: Path) -> None:
    """Blocks of 64: each rank's q, k, v, gate and up rows and o and down columns fall on
    whole blocks."""
    model_dir = make_fp8_block_model(tmp_path, block=(64, 64), **FOUR_KV_HEADS)
    llm = quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(llm) == _transformers_greedy(model_dir)
    finally:
        llm.close()


def test_a_block_split_between_projections_is_refused_naming_the_field(tmp_path: Path) -> None:
    """Two KV heads of 32: k's 64 rows end inside a block of 128 of the fused qkv."""
    model_dir = make_fp8_block_model(tmp_path, num_key_value_heads=2)
    with pytest.raises(ValueError, match="weight_block_size"):
        quantized_llm(model_dir)


def test_dummy_weights_build_an_fp8_model_from_its_config_alone(fp8_dir: Path) -> None:
    llm = quantized_llm(fp8_dir, load_format="dummy")
    assert len(engine_greedy(llm)) == len(PROMPTS)


def _config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    return {**config, **changes}


def test_the_config_reads_the_block_size() -> None:
    assert parse_quantization_config(_config()) == Fp8BlockWeights(128, 128)
    skipped = _config(modules_to_not_convert=["lm_head"])
    assert parse_quantization_config(skipped) == Fp8BlockWeights(128, 128)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": None}, "weight_block_size None"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"modules_to_not_convert": ["model.layers.0.mlp"]}, "modules_to_not_convert"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        parse_quantization_config(_config(**changes))


def test_the_checkpoints_scales_are_what_transformers_reads(fp8_dir: Path) -> None:
    """The hand-written layout is the published one: transformers' dequantized weights equal
    the engine's, layer by layer."""
    ours = quantized_llm(fp8_dir).engine.model
    theirs = AutoModelForCausalLM.from_pretrained(str(fp8_dir), dtype=torch.float32)
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    for layer in range(2):
        fused = ours.model.layers[layer].self_attn.qkv_proj.dequantized_weight()
        hf = theirs.model.layers[layer].self_attn
        expected = torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight])
        assert torch.equal(fused, expected)
        down = ours.model.layers[layer].mlp.down_proj.dequantized_weight()
        assert torch.equal(down, theirs.model.layers[layer].mlp.down_proj.weight)
