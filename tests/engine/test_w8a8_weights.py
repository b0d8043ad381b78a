"""compressed-tensors' 8-bit checkpoints: int8 or float8 weights with a scale per output row
(W8A8, FP8_DYNAMIC) or per weight tensor (FP8, and int8 alike), inputs quantized per token as
they arrive or with a static scale per layer. Made by compressed-tensors itself
(tests/fixtures/quantized_models.py; static input scales calibrated there as llm-compressor's
observer computes them) and checked against transformers running the same files, which
fake-quantizes each linear layer's inputs with compressed-tensors' arithmetic.

A layer, fused projections included (q, k, v and gate, up: transformers runs each part with its
own scales), equals transformers' layers to the bit on the same input. A whole model's greedy
tokens are held to transformers' up to a first divergence where transformers' top two logits
are within ``ACTIVATION_NOISE``, with one of them: rounding the inputs to 8 bits turns float
noise of the order of one rounding step into logit changes of ~0.1 here (transformers' own
cached and uncached forwards of these checkpoints disagree by 0.07)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine.kernels import scaled_matmul
from engine.model_config import load_model_config
from engine.model_loader import load_model
from engine.quantization.config import W8A8Weights, parse_quantization_config
from engine.quantization.w8a8_linear import W8A8Linear, quantize_with_scale
from tests.engine.quantized_runs import (
    PROMPTS,
    engine_greedy,
    projection_bytes,
    quantized_llm,
    set_fields,
    transformers_greedy,
)
from tests.fixtures.quantized_models import make_w8a8_model

ACTIVATION_NOISE = 0.1  # top-2 logit gap under which 8-bit input rounding may pick either token
DISTINCT_PARTS = {"k_proj": 1.5, "up_proj": 0.75}  # input ranges scaled apart: own input_scale


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    weights: W8A8Weights  # what its quantization_config should read as
    input_scale_factors: dict[str, float]


# name -> (kind, weight strategy, static inputs, input scale factors of its parts)
_SCHEMES: dict[str, tuple[str, str, bool, dict[str, float]]] = {
    "int": ("int", "channel", False, {}),  # llm-compressor's W8A8
    "float": ("float", "channel", False, {}),  # FP8_DYNAMIC
    "float-static": ("float", "tensor", True, {}),  # FP8
    "int-static": ("int", "tensor", True, DISTINCT_PARTS),  # int8, parts' input scales apart
}


@pytest.fixture(scope="module", params=list(_SCHEMES))
def w8a8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    kind, strategy, static, factors = _SCHEMES[request.param]
    path = make_w8a8_model(
        tmp_path_factory.mktemp(f"w8a8-{request.param}"),
        kind=kind,
        weight_strategy=strategy,
        static_inputs=static,
        input_scale_factors=factors,
    )
    return Checkpoint(path, W8A8Weights(kind, strategy, static), factors)


def _transformers(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model(torch.tensor([[1, 2, 3]]))  # its first forward decompresses the weights
    return model


def _inputs(num_features: int) -> torch.Tensor:
    """Inputs of the magnitude a layer sees (some past a static scale's range)."""
    return torch.randn(9, num_features, generator=torch.Generator().manual_seed(0)) * 0.5


def test_the_checkpoint_reads_as_its_scheme(w8a8: Checkpoint) -> None:
    assert load_model_config(w8a8.path).quantization == w8a8.weights


def test_a_layer_equals_transformers_layer_to_the_bit(w8a8: Checkpoint) -> None:
    name = "model.layers.0.mlp.down_proj"
    with safe_open(str(w8a8.path / "model.safetensors"), "pt") as f:
        tensors = {leaf: f.get_tensor(f"{name}.{leaf}") for leaf in _leaves(w8a8.weights)}
    weight = tensors["weight"]
    layer = W8A8Linear(weight.shape[1], weight.shape[0], False, w8a8.weights)
    with torch.no_grad():
        for leaf, tensor in tensors.items():
            getattr(layer, leaf).copy_(tensor)  # a [1] per-tensor scale onto every row
        layer.group_rows_by_input_scale()
        x = _inputs(weight.shape[1])
        theirs = _transformers(w8a8.path).get_submodule(name)(x[None])[0]
        assert torch.equal(layer(x), theirs)
        unquantized = torch.nn.functional.linear(x, layer.dequantized_weight())
        assert not torch.allclose(unquantized, theirs, atol=1e-4)  # the inputs were quantized


def _leaves(weights: W8A8Weights) -> tuple[str, ...]:
    return ("weight", "weight_scale") + (("input_scale",) if weights.static_inputs else ())


def test_fused_projections_equal_transformers_parts_to_the_bit(w8a8: Checkpoint) -> None:
    """q, k, v (and gate, up) rows in one layer, each part's weight scale and input scale its
    own: the input quantized with each part's scale, as transformers' separate modules do."""
    model = load_model(w8a8.path, load_model_config(w8a8.path), torch.float32, torch.device("cpu"))
    theirs = _transformers(w8a8.path)
    fused = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    }
    x = _inputs(model.config.hidden_size)
    with torch.no_grad():
        for layer_idx in range(model.config.num_layers):
            for name, parts in fused.items():
                ours = model.get_submodule(f"model.layers.{layer_idx}.{name}")
                block = name.split(".")[0]
                expected = torch.cat(
                    [
                        theirs.get_submodule(f"model.layers.{layer_idx}.{block}.{part}")(x[None])[0]
                        for part in parts
                    ],
                    dim=-1,
                )
                assert torch.equal(ours(x), expected), (layer_idx, name)
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, W8A8Linear)
    if w8a8.input_scale_factors:  # q and v share the input quantized once, k has its own
        assert qkv.input_scale_blocks == ((0, 128, 0), (128, 192, 128), (192, 256, 0))
    else:
        assert qkv.input_scale_blocks == ((0, 256, 0),)


def test_greedy_tokens_equal_transformers(w8a8: Checkpoint) -> None:
    llm = quantized_llm(w8a8.path)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 2 * 4
    element = torch.int8 if w8a8.weights.kind == "int" else torch.float8_e4m3fn
    assert all(layer.weight.dtype == element for layer in layers)
    assert all((layer.input_scale is not None) == w8a8.weights.static_inputs for layer in layers)
    _assert_greedy_tokens_equal_transformers(llm, w8a8.path)


def _assert_greedy_tokens_equal_transformers(llm: Any, model_dir: Path) -> None:
    """``llm``'s greedy tokens equal transformers' on ``model_dir``, but where a first
    divergence falls on a near tie (``ACTIVATION_NOISE``), for at most half the prompts."""
    model = _transformers(model_dir)
    num_diverged = 0
    for prompt, tokens, expected in zip(
        PROMPTS, engine_greedy(llm), transformers_greedy(model), strict=True
    ):
        if tokens == expected:
            continue
        num_diverged += 1
        position = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected[:position]])).logits[0, -1]
        top2 = torch.topk(logits, 2)
        assert float(top2.values[0] - top2.values[1]) < ACTIVATION_NOISE, (prompt, position)
        assert tokens[position] in top2.indices.tolist()
    assert num_diverged <= len(PROMPTS) // 2


@pytest.mark.parametrize("kind", ["int", "float"])
def test_projections_fused_on_disk_take_their_one_scale(kind: str, tmp_path: Path) -> None:
    """Phi-3 stores q, k, v in one qkv_proj (and gate, up in one gate_up_proj): one weight
    scale and one input scale each, on all of its rows, on one rank and on two."""
    model_dir = make_w8a8_model(
        tmp_path,
        kind=kind,
        weight_strategy="tensor",
        static_inputs=True,
        architecture="Phi3ForCausalLM",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    llm = quantized_llm(model_dir)
    _assert_greedy_tokens_equal_transformers(llm, model_dir)
    two = quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(two) == engine_greedy(llm)
    finally:
        two.close()


def test_weights_take_a_quarter_of_their_float32_bytes(w8a8: Checkpoint) -> None:
    """A byte a weight, and a float32 weight scale (and input scale) a row of 128 or 256."""
    options: dict[str, Any] = {"linear_backend": "torch"}  # float weights as nn.Linear holds
    ratio = projection_bytes(quantized_llm(w8a8.path, **options)) / projection_bytes(
        quantized_llm(w8a8.path.parent / "float", **options)
    )
    assert 0.25 < ratio < 0.27


def test_two_tensor_parallel_ranks_equal_one(w8a8: Checkpoint) -> None:
    """Rows of q, k, v, gate and up and their scales split over the ranks (a per-tensor
    scale on the rows of its part on each rank); o's and down's inputs split, each rank's
    input rows quantized with the whole row's scale (the ranks share each token's largest
    magnitude) or the layer's static scale, their weight scales on both ranks."""
    expected = engine_greedy(quantized_llm(w8a8.path))
    two = quantized_llm(w8a8.path, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(two) == expected
    finally:
        two.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs a CPU model through the interpreter")
def test_the_gpu_gemm_path_decodes_as_the_cpu_path(
    w8a8: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection through engine/kernels/scaled_matmul.py's 8-bit GEMM (Triton's
    interpreter here, as on a GPU): per-token or static input scales, a fused projection's
    blocks of rows each with its own, the greedy tokens of transformers on the same files, as
    the dequantizing path's are (up to the same near ties: the GEMM sums 8-bit products
    exactly, the dequantizing path in float32, whose rounding order is the CPU's)."""
    calls: list[int] = []
    gemm = scaled_matmul.w8a8_matmul

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return gemm(x, *args, **kwargs)

    monkeypatch.setattr(scaled_matmul, "usable", lambda x: x.dtype == torch.float32)
    monkeypatch.setattr(scaled_matmul, "w8a8_matmul", counted)
    _assert_greedy_tokens_equal_transformers(quantized_llm(w8a8.path), w8a8.path)
    assert calls


def test_dummy_weights_build_a_w8a8_model_from_its_config_alone(w8a8: Checkpoint) -> None:
    assert len(engine_greedy(quantized_llm(w8a8.path, load_format="dummy"))) == len(PROMPTS)


@pytest.mark.parametrize("kind", ["int", "float"])
def test_a_static_scale_quantizes_as_compressed_tensors(kind: str) -> None:
    """Ties, the type's ends and past them, against compressed-tensors' own fake_quantize."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = QuantizationArgs(num_bits=8, type=kind, strategy="tensor", symmetric=True)
    scale = torch.tensor([0.5])
    ties = torch.arange(-260, 261, dtype=torch.float32) / 4  # x / scale in steps of 0.5
    x = torch.cat([ties, torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 300])
    theirs = fake_quantize(x, scale, None, args)
    assert torch.equal(quantize_with_scale(x, scale, kind), theirs)
    if kind == "int":
        assert quantize_with_scale(
            torch.tensor([0.25, 0.75, -64.25, -70.0]), scale, kind
        ).tolist() == [
            0.0,
            1.0,
            -64.0,
            -64.0,
        ]  # 0.5 -> 0 and 1.5 -> 2 (half to even), clamped to -128 and 127 steps


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


_STATIC = {"input_activations.dynamic": False, "input_activations.strategy": "tensor"}


def test_the_config_reads_the_8_bit_schemes() -> None:
    assert parse_quantization_config(_group()) == W8A8Weights("int")
    fp8 = _group(
        format="float-quantized",
        **{"weights.type": "float", "input_activations.type": "float"},
    )
    assert parse_quantization_config(fp8) == W8A8Weights("float")
    fp8_static = _group(
        format="float-quantized",
        **{"weights.type": "float", "input_activations.type": "float"},
        **{"weights.strategy": "tensor", **_STATIC},
    )
    assert parse_quantization_config(fp8_static) == W8A8Weights("float", "tensor", True)
    assert parse_quantization_config(_group(**_STATIC)) == W8A8Weights("int", "channel", True)
    per_tensor = _group(**{"weights.strategy": "tensor"})
    assert parse_quantization_config(per_tensor) == W8A8Weights("int", "tensor", False)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"input_activations.dynamic": False}, "input_activations.strategy 'token'"),
        ({"input_activations.strategy": "tensor"}, "input_activations.strategy 'tensor'"),
        ({"input_activations.dynamic": "local"}, "input_activations.dynamic 'local'"),
        ({**_STATIC, "input_activations.symmetric": False}, "input_activations.symmetric False"),
        ({"input_activations.symmetric": False}, "input_activations.symmetric False"),
        ({"input_activations.type": "float"}, "input_activations.type 'float'"),
        ({"weights.strategy": "group"}, "weights.strategy 'group'"),
        ({"weights.strategy": "block"}, "weights.strategy 'block'"),
        ({"weights.symmetric": False}, "weights.symmetric False"),
        ({"input_activations": None}, "input_activations must be an object"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=f"config_groups.group_0.{field}"):
        parse_quantization_config(_group(**changes))
