"""AWQ checkpoints as published (AutoAWQ's GEMM layout: 4-bit integers packed along the outputs
in AWQ's interleaved order, a float16 scale and a zero point per group), hand-packed in
tests/fixtures/awq_gptq_models.py: loaded into the engine's packed layout without unpacking a
layer for good, every layer dequantizing bit for bit to the float weights the integers were
made from, and run to the greedy tokens transformers gives on those float weights; on two
tensor-parallel ranks too. Configs the engine cannot run are refused at load, naming the field.

transformers runs AWQ checkpoints on CPU only through gptqmodel, which does not install here
(docs/quantized-checkpoints.md), hence the float model as the reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.quantization.awq_gptq import to_layer_rows
from engine.quantization.config import PackedIntWeights, parse_quantization_config
from engine.quantization.packed_linear import PackedIntLinear, unpack_int32
from tests.engine.quantized_runs import (
    assert_dequantized_exactly,
    engine_greedy,
    projection_bytes,
    quantized_llm,
    set_fields,
    transformers_greedy,
)
from tests.fixtures.awq_gptq_models import AWQ_ORDER, make_awq_model, pack_columns

# (group size, architecture): Qwen2's q, k and v have float biases beside their packed weights
SCHEMES = [(32, "LlamaForCausalLM"), (128, "Qwen2ForCausalLM")]


@pytest.fixture(scope="module", params=SCHEMES, ids=["g32-llama", "g128-qwen2"])
def awq_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    group_size, architecture = request.param
    root = tmp_path_factory.mktemp(f"awq-g{group_size}")
    return make_awq_model(root, group_size=group_size, architecture=architecture)


def _float_greedy(model_dir: Path) -> list[list[int]]:
    """transformers on the float32 model the checkpoint's integers stand for."""
    dequantized = str(model_dir.parent / "dequantized")
    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    return transformers_greedy(model)


def test_layers_dequantize_exactly_and_greedy_tokens_equal_transformers(awq_dir: Path) -> None:
    llm = quantized_llm(awq_dir)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, PackedIntLinear)]
    assert all(layer.weight_packed.dtype == torch.int32 for layer in layers)
    assert assert_dequantized_exactly(llm, awq_dir.parent / "dequantized") == 2 * 4
    expected = _float_greedy(awq_dir)
    assert engine_greedy(llm) == expected
    # the quantization is not a no-op: the float model it came from decodes otherwise
    assert engine_greedy(quantized_llm(awq_dir.parent / "float")) != expected


def test_two_tensor_parallel_ranks_equal_transformers(tmp_path: Path) -> None:
    """Output columns (q, k, v, gate, up: in words for qweight and qzeros) and input rows (o,
    down: in groups for scales and zero points) split over the ranks."""
    model_dir = make_awq_model(tmp_path, group_size=32)
    llm = quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    try:
        assert engine_greedy(llm) == _float_greedy(model_dir)
    finally:
        llm.close()


def test_a_slice_that_cuts_a_group_is_refused_naming_the_field(tmp_path: Path) -> None:
    """Groups of 128 inputs, and o_proj's 128 inputs over two ranks: 64 each."""
    model_dir = make_awq_model(tmp_path, group_size=128)
    with pytest.raises(ValueError, match="group_size"):
        quantized_llm(model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)


def test_four_bit_weights_take_about_a_quarter_of_their_bfloat16_bytes(tmp_path: Path) -> None:
    model_dir = make_awq_model(tmp_path, group_size=128)
    options: dict[str, Any] = {"dtype": "bfloat16", "linear_backend": "torch"}
    packed = quantized_llm(model_dir, **options)
    dense = quantized_llm(tmp_path / "float", **options)
    ratio = projection_bytes(packed) / projection_bytes(dense)
    # 4 of 16 bits, a bfloat16 scale and a 4-bit zero point per 128 weights
    assert 0.25 < ratio < 0.27


def test_awq_words_hold_their_columns_in_the_interleaved_order() -> None:
    """AutoAWQ packs columns 0..7 of a word into nibbles 0, 2, 4, 6, 1, 3, 5, 7 (nibble k holds
    column AWQ_ORDER[k] = 0, 2, 4, 6, 1, 3, 5, 7): the word whose nibble k is k holds, by
    column, 0, 4, 1, 5, 2, 6, 3, 7; our rows pack them in order, lowest nibble first, offset
    by 8 to signed."""
    weights = PackedIntWeights(4, 8, symmetric=False, method="awq")
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32).repeat(8, 1)  # [in 8, out 8 / 8]
    rows = to_layer_rows("weight_packed", weights)(qweight)  # [out 8, in 8 / 8]
    columns = unpack_int32(rows, 4, 8)[:, 0] + 8  # each output's integer (at input 0)
    assert columns.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    zeros = to_layer_rows("weight_zero_point", weights)(qweight[:1])  # [out 8 / 8, groups 1]
    assert (unpack_int32(zeros.t(), 4, 8)[0] + 8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_a_tall_qweight_converts_input_slice_by_input_slice() -> None:
    """More inputs than one conversion pass takes (1024): the packer's integers come back."""
    generator = torch.Generator().manual_seed(0)
    integers = torch.randint(0, 16, (2056, 24), generator=generator)  # [in, out]
    qweight = pack_columns(integers, 4, AWQ_ORDER)  # [in, out / 8]
    weights = PackedIntWeights(4, 8, symmetric=False, method="awq")
    rows = to_layer_rows("weight_packed", weights)(qweight)  # [out, in / 8]
    assert torch.equal(unpack_int32(rows, 4, 2056) + 8, integers.t().int())


def _config(**changes: Any) -> dict[str, Any]:
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    set_fields(config, changes)
    return copy.deepcopy(config)


def test_the_config_reads_group_size_and_the_legacy_names() -> None:
    assert parse_quantization_config(_config()) == PackedIntWeights(
        4, 128, symmetric=False, method="awq"
    )
    assert parse_quantization_config(_config(group_size=-1)).group_size is None
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True}
    assert parse_quantization_config({**autoawq, "version": "GEMM"}).group_size == 64
    assert parse_quantization_config({**autoawq, "format": "gemm"}).group_size == 64


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"version": "gemv"}, "quantization_config.version 'gemv'"),
        ({"version": "exllama"}, "quantization_config.version 'exllama'"),
        ({"version": "marlin"}, "quantization_config.version 'marlin'"),
        ({"version": None, "format": "gemv_fast"}, "quantization_config.format 'gemv_fast'"),
        ({"zero_point": False}, "quantization_config.zero_point False"),
        ({"bits": 8}, "quantization_config.bits 8"),
        ({"bits": 3}, "quantization_config.bits 3"),
        ({"group_size": 0}, "quantization_config.group_size 0"),
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
    model_dir = make_awq_model(tmp_path, group_size=32)
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw["quantization_config"]["version"] = "gemv"
    config_path.write_text(json.dumps(raw))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"quantization_config\.version 'gemv'"):
        quantized_llm(model_dir)
