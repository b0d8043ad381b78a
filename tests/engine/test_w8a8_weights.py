"""compressed-tensors' W8A8 (int8) and FP8_DYNAMIC (float8) checkpoints: 8-bit weights with a
scale per output row, inputs quantized per token as they arrive. Made by compressed-tensors
itself (tests/fixtures/quantized_models.py) and checked against transformers running the same
files, which fake-quantizes each linear layer's inputs with compressed-tensors' arithmetic.

A layer equals transformers' layer to the bit on the same input. A whole model's greedy tokens
equal transformers' for FP8; int8's per-token rounding turns float noise of the order of one
rounding step into logit changes of ~0.1 here (transformers' own cached and uncached forwards
of these checkpoints disagree by 0.07), so int8 is held to transformers' tokens up to a first
divergence where transformers' top two logits are that close, with one of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine.quantization.config import W8A8Weights, parse_quantization_config
from engine.quantization.w8a8_linear import W8A8Linear
from tests.engine.quantized_runs import (
    PROMPTS,
    engine_greedy,
    quantized_llm,
    set_fields,
    transformers_greedy,
)
from tests.fixtures.quantized_models import make_w8a8_model

INT8_NOISE = 0.1  # top-2 logit gap under which int8 activation rounding may pick either token


@pytest.fixture(scope="module", params=["int", "float"])
def w8a8_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_w8a8_model(tmp_path_factory.mktemp(f"w8a8-{request.param}"), kind=request.param)


def _kind(model_dir: Path) -> str:
    return "int" if "w8a8-int" in str(model_dir) else "float"


def _transformers(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_a_layer_equals_transformers_layer_to_the_bit(w8a8_dir: Path) -> None:
    name = "model.layers.0.mlp.down_proj"
    with safe_open(str(w8a8_dir / "model.safetensors"), "pt") as f:
        weight, scale = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale")
    layer = W8A8Linear(weight.shape[1], weight.shape[0], False, W8A8Weights(_kind(w8a8_dir)))
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(scale)
        x = torch.randn(9, weight.shape[1], generator=torch.Generator().manual_seed(0)) * 2
        model = _transformers(w8a8_dir)
        model(torch.tensor([[1, 2, 3]]))  # its first forward decompresses the weights
        theirs = model.get_submodule(name)(x[None])[0]
        assert torch.equal(layer(x), theirs)
        unquantized = torch.nn.functional.linear(x, layer.dequantized_weight())
        assert not torch.allclose(unquantized, theirs, atol=1e-4)  # the inputs were quantized


def test_greedy_tokens_equal_transformers(w8a8_dir: Path) -> None:
    llm = quantized_llm(w8a8_dir)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 2 * 4
    element = torch.int8 if _kind(w8a8_dir) == "int" else torch.float8_e4m3fn
    assert all(layer.weight.dtype == element for layer in layers)
    model = _transformers(w8a8_dir)
    num_diverged = 0
    for prompt, tokens, expected in zip(
        PROMPTS, engine_greedy(llm), transformers_greedy(model), strict=True
    ):
        if tokens == expected:
            continue
        assert _kind(w8a8_dir) == "int", (prompt, tokens, expected)
        num_diverged += 1
        position = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected[:position]])).logits[0, -1]
        top2 = torch.topk(logits, 2)
        assert float(top2.values[0] - top2.values[1]) < INT8_NOISE, (prompt, position)
        assert tokens[position] in top2.indices.tolist()
    assert num_diverged <= len(PROMPTS) // 2


def test_two_tensor_parallel_ranks_equal_one(w8a8_dir: Path) -> None:
    """Rows of q, k, v, gate and up and their scales split over the ranks; o's and down's
    inputs split, each rank's input rows quantized with the whole row's scale (the ranks share
    each token's largest magnitude), their weight scales on both ranks."""
    expected = engine_greedy(quantized_llm(w8a8_dir))
    two = quantized_llm(w8a8_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(two) == expected
    finally:
        two.close()


def test_dummy_weights_build_a_w8a8_model_from_its_config_alone(w8a8_dir: Path) -> None:
    assert len(engine_greedy(quantized_llm(w8a8_dir, load_format="dummy"))) == len(PROMPTS)


def _group(**changes: Any) -> dict[str, Any]:
    group = {
        "format": "int-quantized",
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        },
        "output_activations": None,
    }
    set_fields(group, changes)
    return {
        "quant_method": "compressed-tensors",
        "format": group["format"],
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def test_the_config_reads_the_8_bit_schemes() -> None:
    assert parse_quantization_config(_group()) == W8A8Weights("int")
    fp8 = _group(
        format="float-quantized",
        **{"weights.type": "float", "input_activations.type": "float"},
    )
    assert parse_quantization_config(fp8) == W8A8Weights("float")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"input_activations.dynamic": False}, "input_activations.dynamic False"),
        ({"input_activations.strategy": "tensor"}, "input_activations.strategy 'tensor'"),
        ({"weights.strategy": "tensor"}, "weights.strategy 'tensor'"),
        ({"weights.symmetric": False}, "weights.symmetric False"),
        ({"input_activations": None}, "input_activations must be an object"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=f"config_groups.group_0.{field}"):
        parse_quantization_config(_group(**changes))
