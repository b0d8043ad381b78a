"""Quantized checkpoints as published: compressed-tensors' pack-quantized W4A16 and W8A16
(symmetric and asymmetric, per group and per channel), made by compressed-tensors itself
(tests/fixtures/quantized_models.py), loaded with their weights packed and run to the same
greedy tokens as transformers running the same checkpoint; on two tensor-parallel ranks too.
Configs the engine cannot run are refused at load, naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from engine.model_config import load_model_config
from engine.quantization.config import PackedIntWeights, parse_quantization_config
from engine.quantization.packed_linear import PackedIntLinear, unpack_int32
from tests.engine.quantized_runs import (
    PROMPTS,
    engine_greedy,
    projection_bytes,
    quantized_llm,
    set_fields,
    transformers_greedy,
)
from tests.fixtures.quantized_models import make_pack_quantized_model

# (bits, group size or None for one scale per row, symmetric)
SCHEMES = [(4, 32, True), (4, 128, False), (8, None, True), (8, 32, False)]


def _scheme_id(scheme: tuple[int, int | None, bool]) -> str:
    bits, group, symmetric = scheme
    return f"w{bits}-{'channel' if group is None else f'g{group}'}-{'sym' if symmetric else 'asym'}"


@pytest.fixture(scope="module", params=SCHEMES, ids=_scheme_id)
def quantized_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bits, group, symmetric = request.param
    root = tmp_path_factory.mktemp(_scheme_id(request.param))
    return make_pack_quantized_model(root, num_bits=bits, group_size=group, symmetric=symmetric)


def _transformers_greedy(model_dir: Path) -> list[list[int]]:
    """transformers with compressed-tensors, its weights dequantized at load (its default mode
    cannot load asymmetric zero points in this version: docs/quantized-checkpoints.md)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    ).eval()
    return transformers_greedy(model)


def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(quantized_dir: Path) -> None:
    llm = quantized_llm(quantized_dir)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down of both layers, still packed
    assert all(layer.weight_packed.dtype == torch.int32 for layer in layers)
    expected = _transformers_greedy(quantized_dir)
    assert engine_greedy(llm) == expected
    # the quantization is not a no-op: the float model it came from decodes otherwise
    assert engine_greedy(quantized_llm(quantized_dir.parent / "float")) != expected


@pytest.mark.parametrize(
    "scheme", [(4, 32, False), (8, None, True)], ids=["w4-g32-asym", "w8-channel-sym"]
)
def test_two_tensor_parallel_ranks_equal_transformers(
    tmp_path: Path, scheme: tuple[int, int | None, bool]
) -> None:
    """Rows (q, k, v, gate, up; the zero points' packed rows) and input columns (o, down: in
    words and in groups; a per-channel scale on both ranks) split over the ranks."""
    bits, group, symmetric = scheme
    model_dir = make_pack_quantized_model(
        tmp_path, num_bits=bits, group_size=group, symmetric=symmetric
    )
    llm = quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(llm) == _transformers_greedy(model_dir)
    finally:
        llm.close()


def test_a_slice_that_cuts_a_group_is_refused_naming_the_field(tmp_path: Path) -> None:
    """Groups of 128 inputs, and o_proj's 128 inputs over two ranks: 64 each."""
    model_dir = make_pack_quantized_model(tmp_path, num_bits=4, group_size=128, symmetric=True)
    with pytest.raises(ValueError, match="group_size"):
        quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)


def test_four_bit_weights_take_about_a_quarter_of_their_bfloat16_bytes(tmp_path: Path) -> None:
    model_dir = make_pack_quantized_model(tmp_path, num_bits=4, group_size=128, symmetric=True)
    options: dict[str, Any] = {"dtype": "bfloat16", "linear_backend": "torch"}
    packed, dense = (
        quantized_llm(model_dir, **options),
        quantized_llm(tmp_path / "float", **options),
    )

    ratio = projection_bytes(packed) / projection_bytes(dense)
    assert 0.25 < ratio < 0.27  # 4 of 16 bits, and a bfloat16 scale per 128 weights


def test_dummy_weights_build_a_quantized_model_from_its_config_alone(tmp_path: Path) -> None:
    model_dir = make_pack_quantized_model(tmp_path, num_bits=4, group_size=32, symmetric=False)
    (model_dir / "model.safetensors").unlink()
    llm = quantized_llm(model_dir, load_format="dummy")
    assert len(engine_greedy(llm)) == len(PROMPTS)
    with pytest.raises(ValueError, match="one rank only"):
        quantized_llm(model_dir, load_format="dummy", tensor_parallel_size=2)


def test_unpacking_inverts_compressed_tensors_packing() -> None:
    generator = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        low = -(1 << (bits - 1))
        values = torch.randint(low, -low, (16, 64), generator=generator, dtype=torch.int32)
        packed = pack_to_int32(values.to(torch.int8), bits)
        assert torch.equal(unpack_int32(packed, bits, 64), values)
        rows = pack_to_int32(values.to(torch.int8), bits, packed_dim=0)  # zero points' way
        assert torch.equal(unpack_int32(rows.t(), bits, 16).t(), values)


def _config(**changes: Any) -> dict[str, Any]:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 128,
        "dynamic": False,
        "actorder": None,
    }
    group = {
        "format": "pack-quantized",
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    set_fields(config, changes)
    return copy.deepcopy(config)


def test_the_config_reads_bits_groups_and_zero_points() -> None:
    assert parse_quantization_config(_config()) == PackedIntWeights(4, 128, True)
    channel = _config(**{"config_groups.group_0.weights.strategy": "channel"})
    assert parse_quantization_config(channel).group_size is None
    asym = _config(**{"config_groups.group_0.weights.symmetric": False})
    assert not parse_quantization_config(asym).symmetric


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method 'bitsandbytes'"),
        (
            {"config_groups.group_0.input_activations": {"num_bits": 8, "type": "float"}},
            "quantization_config.config_groups.group_0.input_activations",
        ),
        (
            {"config_groups.group_0.format": "marlin-24"},
            "quantization_config.config_groups.group_0.format 'marlin-24'",
        ),
        (
            {"config_groups.group_0.weights.num_bits": 2},
            "quantization_config.config_groups.group_0.weights.num_bits 2",
        ),
        (
            {"config_groups.group_0.weights.actorder": "group"},
            "quantization_config.config_groups.group_0.weights.actorder 'group'",
        ),
        (
            {"config_groups.group_0.weights.strategy": "tensor"},
            "quantization_config.config_groups.group_0.weights.strategy 'tensor'",
        ),
        ({"ignore": ["lm_head", "re:.*mlp.*"]}, "quantization_config.ignore"),
        ({"quantization_status": "frozen"}, "quantization_config.quantization_status 'frozen'"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("*", r"\*")):
        parse_quantization_config(_config(**changes))


def test_an_unsupported_checkpoint_is_refused_at_load_naming_the_field(tmp_path: Path) -> None:
    """A pack-quantized checkpoint whose activations are quantized too (only the 8-bit int and
    float formats run so): refused from config.json, before any weight is read, and a W8A16
    Mixtral whose ``ignore`` leaves its router gates quantized likewise (a router stays
    float)."""
    model_dir = make_pack_quantized_model(tmp_path, num_bits=8, group_size=None, symmetric=True)
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    group = raw["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}
    config_path.write_text(json.dumps(raw))
    (model_dir / "model.safetensors").unlink()  # nothing is read past the config
    with pytest.raises(ValueError, match=r"group_0\.input_activations is set"):
        quantized_llm(model_dir)
    raw["architectures"] = ["MixtralForCausalLM"]
    raw["model_type"] = "mixtral"
    raw["num_local_experts"], raw["num_experts_per_tok"] = 4, 2
    group["input_activations"] = None
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="quantization_config .* not supported for Mixtral.*gate"):
        load_model_config(model_dir)
