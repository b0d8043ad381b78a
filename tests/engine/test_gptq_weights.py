"""GPTQ checkpoints as published (GPTQModel's layout: 4- or 8-bit integers packed along the
inputs, zero points along the outputs, stored minus one in the "gptq" format, a float16 scale
per group, g_idx), hand-packed in tests/fixtures/awq_gptq_models.py: symmetric and not, per
group and per row, in input order and in activation order (desc_act). Each loads into the
engine's packed layout, every layer dequantizing bit for bit to the float weights the integers
were made from, and runs to the greedy tokens transformers gives on those float weights; on two
tensor-parallel ranks too. Configs the engine cannot run are refused, naming the field.

transformers runs GPTQ checkpoints on CPU only through optimum and gptqmodel, which do not
install here (docs/quantized-checkpoints.md), hence the float model as the reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.kernels import packed_int_matmul
from engine.quantization.awq_gptq import to_layer_rows
from engine.quantization.config import PackedIntWeights, parse_quantization_config
from engine.quantization.packed_linear import PackedIntLinear, pack_int32, unpack_int32
from tests.engine.quantized_runs import (
    PROMPTS,
    assert_dequantized_exactly,
    engine_greedy,
    projection_bytes,
    quantized_llm,
    set_fields,
    transformers_greedy,
)
from tests.fixtures.awq_gptq_models import make_gptq_model

# (bits, group size (-1: one a row), symmetric, act order, checkpoint_format)
SCHEMES = [
    (4, 32, True, False, "gptq"),
    (4, 64, False, False, "gptq"),  # zero points of 0: a v1 word borrows across its fields
    (8, -1, False, False, "gptq"),
    (4, 32, False, False, "gptq_v2"),  # on Qwen2: float q, k, v biases beside packed weights
    (4, 32, False, True, "gptq"),
]


def _scheme_id(scheme: tuple[int, int, bool, bool, str]) -> str:
    bits, group, symmetric, act_order, fmt = scheme
    parts = [f"w{bits}", "channel" if group == -1 else f"g{group}", "sym" if symmetric else "asym"]
    return "-".join(parts + (["act-order"] if act_order else []) + [fmt])


def _make(root: Path, scheme: tuple[int, int, bool, bool, str]) -> Path:
    bits, group, symmetric, act_order, fmt = scheme
    return make_gptq_model(
        root,
        num_bits=bits,
        group_size=group,
        symmetric=symmetric,
        act_order=act_order,
        checkpoint_format=fmt,
        architecture="Qwen2ForCausalLM" if fmt == "gptq_v2" else "LlamaForCausalLM",
    )


@pytest.fixture(scope="module", params=SCHEMES, ids=_scheme_id)
def gptq_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp(_scheme_id(request.param)), request.param)


def _float_greedy(model_dir: Path) -> list[list[int]]:
    """transformers on the float32 model the checkpoint's integers stand for."""
    dequantized = str(model_dir.parent / "dequantized")
    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    return transformers_greedy(model)


def test_layers_dequantize_exactly_and_greedy_tokens_equal_transformers(gptq_dir: Path) -> None:
    llm = quantized_llm(gptq_dir)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, PackedIntLinear)]
    assert all(layer.weight_packed.dtype == torch.int32 for layer in layers)
    assert all(layer.g_idx is None for layer in layers)  # read, then dropped
    act_order = json.loads((gptq_dir / "config.json").read_text())["quantization_config"][
        "desc_act"
    ]
    assert all((layer.input_order is not None) == act_order for layer in layers)
    assert assert_dequantized_exactly(llm, gptq_dir.parent / "dequantized") == 2 * 4
    expected = _float_greedy(gptq_dir)
    assert engine_greedy(llm) == expected
    assert engine_greedy(quantized_llm(gptq_dir.parent / "float")) != expected


@pytest.mark.parametrize(
    "scheme",
    [(4, 32, False, False, "gptq"), (8, -1, True, False, "gptq")],
    ids=["w4-g32-asym", "w8-channel-sym"],
)
def test_two_tensor_parallel_ranks_equal_transformers(
    tmp_path: Path, scheme: tuple[int, int, bool, bool, str]
) -> None:
    """Output columns (q, k, v, gate, up; qzeros in words of them) and input rows (o, down:
    qweight in words, scales, zero points and g_idx in groups; one group a row on both ranks)
    split over the ranks."""
    model_dir = _make(tmp_path, scheme)
    llm = quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(llm) == _float_greedy(model_dir)
    finally:
        llm.close()


def test_activation_order_on_two_ranks_is_refused_naming_the_field(tmp_path: Path) -> None:
    model_dir = make_gptq_model(tmp_path, group_size=32, act_order=True)
    with pytest.raises(ValueError, match=r"quantization_config\.desc_act"):
        quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)


def test_fused_parts_in_different_activation_orders_are_refused(tmp_path: Path) -> None:
    """q, k and v share one input order in a checkpoint GPTQ wrote (they see the same inputs);
    one that gives k another order cannot be one fused projection."""
    model_dir = make_gptq_model(tmp_path, group_size=32, symmetric=False, act_order=True)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"fused projection's parts .*desc_act"):
        quantized_llm(model_dir)


def test_four_bit_weights_take_about_a_quarter_of_their_bfloat16_bytes(tmp_path: Path) -> None:
    model_dir = make_gptq_model(tmp_path, group_size=128)
    options: dict[str, Any] = {"dtype": "bfloat16", "linear_backend": "torch"}
    packed = quantized_llm(model_dir, **options)
    dense = quantized_llm(tmp_path / "float", **options)
    ratio = projection_bytes(packed) / projection_bytes(dense)
    # 4 of 16 bits, a bfloat16 scale and a 4-bit zero point per 128 weights; g_idx dropped
    assert 0.25 < ratio < 0.27


def test_dummy_weights_build_a_gptq_model_from_its_config_alone(tmp_path: Path) -> None:
    model_dir = make_gptq_model(tmp_path, group_size=32, act_order=True)
    (model_dir / "model.safetensors").unlink()
    llm = quantized_llm(model_dir, load_format="dummy")
    assert len(engine_greedy(llm)) == len(PROMPTS)


def test_v1_zero_points_come_back_as_gptqmodel_wrote_them() -> None:
    """GPTQModel writes the "gptq" format's zero points as the word of the zero points minus
    0x11111111 (4 bits): a zero point of 0 borrows from the next field. Adding the same back as
    one integer returns every zero point, 0 and 15 too."""
    zeros = torch.tensor([[0, 5, 0, 15, 1, 0, 7, 0]])  # [groups 1, out 8]
    word = sum(int(zero) << (4 * field) for field, zero in enumerate(zeros[0]))
    stored = (word - 0x11111111) % (1 << 32)
    qzeros = torch.tensor([[stored - (1 << 32) if stored >= 1 << 31 else stored]])
    weights = PackedIntWeights(4, 32, True, method="gptq", zeros_minus_one=True)
    rows = to_layer_rows("weight_zero_point", weights)(qzeros.to(torch.int32))  # [1, groups]
    assert torch.equal(unpack_int32(rows.t(), 4, 8) + 8, zeros.int())


def test_inputs_in_activation_order_are_sorted_by_group_exactly() -> None:
    """A layer of more output rows than one reordering pass takes (1024), its g_idx a random
    order of groups of 16: the weight it dequantizes is (q - 8) * scale of each input's group,
    inputs in the checkpoint's order."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features, group = 1032, 64, 16
    weights = PackedIntWeights(4, group, True, method="gptq", act_order=True)
    layer = PackedIntLinear(in_features, out_features, False, weights)
    integers = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scale = torch.rand(out_features, in_features // group, generator=generator)
    g_idx = (torch.randperm(in_features, generator=generator) // group).int()
    assert layer.g_idx is not None and layer.weight_zero_point is not None
    with torch.no_grad():
        layer.weight_packed.copy_(pack_int32(integers, 4))
        layer.weight_scale.copy_(scale)
        layer.weight_zero_point.fill_(-0x77777778)  # 0x88888888: every zero point 8
        layer.g_idx.copy_(g_idx)
        layer.order_inputs_by_group()
    expected = (integers - 8).float() * scale[:, g_idx.long()]
    assert layer.g_idx is None and layer.input_order is not None
    assert torch.equal(layer.dequantized_weight(), expected)


def test_the_gpu_path_gathers_inputs_in_the_weights_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer in activation order: the Triton kernel (in its interpreter here) on the inputs
    gathered in the sorted weight's order gives the torch path's output."""
    model_dir = make_gptq_model(tmp_path, group_size=32, symmetric=False, act_order=True)
    llm = quantized_llm(model_dir)
    layer = llm.engine.model.model.layers[0].self_attn.o_proj
    assert isinstance(layer, PackedIntLinear) and layer.input_order is not None
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    expected = layer(x)
    monkeypatch.setattr(packed_int_matmul, "usable", lambda x: True)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def _config(**changes: Any) -> dict[str, Any]:
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "lm_head": False,
        "true_sequential": True,
        "damp_percent": 0.01,
    }
    set_fields(config, changes)
    return copy.deepcopy(config)


def test_the_config_reads_bits_groups_order_and_format() -> None:
    parsed = parse_quantization_config(_config())
    assert parsed == PackedIntWeights(4, 128, True, method="gptq", zeros_minus_one=True)
    assert parsed.has_zero_points  # read from the checkpoint, symmetric or not
    assert parse_quantization_config(_config(group_size=-1)).group_size is None
    assert parse_quantization_config(_config(desc_act=True)).act_order
    assert not parse_quantization_config(_config(checkpoint_format="gptq_v2")).zeros_minus_one
    # transformers' older configs: "format", or neither (v1)
    optimum = {k: v for k, v in _config().items() if k != "checkpoint_format"}
    assert parse_quantization_config(optimum).zeros_minus_one
    assert not parse_quantization_config({**optimum, "format": "gptq_v2"}).zeros_minus_one


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"bits": 3}, "quantization_config.bits 3"),
        ({"bits": 2}, "quantization_config.bits 2"),
        ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin'"),
        ({"checkpoint_format": None, "format": "bitblas"}, "quantization_config.format"),
        ({"desc_act": "yes"}, "quantization_config.desc_act"),
        ({"sym": None}, "quantization_config.sym"),
        ({"group_size": 0}, "quantization_config.group_size 0"),
        ({"pack_dtype": "int16"}, "quantization_config.pack_dtype 'int16'"),
        ({"lm_head": True}, "quantization_config.lm_head"),
        ({"dynamic": {"-:.*down_proj.*": {}}}, "quantization_config.dynamic"),
        (
            {"modules_in_block_to_quantize": [["self_attn.q_proj"]]},
            "quantization_config.modules_in_block_to_quantize",
        ),
        ({"modules_to_not_convert": ["mlp"]}, "quantization_config.modules_to_not_convert"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_quantization_config(_config(**changes))


def test_an_unsupported_checkpoint_is_refused_at_load_naming_the_field(tmp_path: Path) -> None:
    """From config.json, before any weight is read."""
    model_dir = make_gptq_model(tmp_path, group_size=32)
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw["quantization_config"]["bits"] = 3
    config_path.write_text(json.dumps(raw))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"quantization_config\.bits 3"):
        quantized_llm(model_dir)
