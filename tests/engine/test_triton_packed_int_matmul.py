"""The Triton packed-integer matmul (engine/kernels/packed_int_matmul.py) against
``PackedIntLinear``'s torch path (dequantize the whole weight, then ``F.linear``), on weights
packed by compressed-tensors' own ``pack_to_int32``.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which is slow: shapes stay small. The integers span their whole range and the scales and zero
points differ per output and group, so a dropped zero point or scale, a wrong shift or a wrong
group moves float32 results far past the 1e-5 they are held to. The interpreter rounds float32
to bfloat16 by truncation (a GPU rounds to nearest even), so bfloat16 is held to a few steps of
the output's scale; float16 to two steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from engine import LLM, SamplingParams
from engine.kernels import packed_int_matmul as kernels
from engine.kernels.matmul_tiling import MatmulTiling
from engine.kernels.packed_int_matmul import default_tiling, packed_int_matmul
from engine.quantization.config import PackedIntWeights
from engine.quantization.packed_linear import PackedIntLinear
from tests.fixtures.quantized_models import make_pack_quantized_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN_FEATURES, OUT_FEATURES = 256, 72  # 72: a partial last column tile of 32 and of 64


def _layer(
    bits: int,
    group: int | None,
    symmetric: bool,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    in_features: int = IN_FEATURES,
    out_features: int = OUT_FEATURES,
    seed: int = 0,
) -> PackedIntLinear:
    """A layer of random integers over their whole range, packed by compressed-tensors, with a
    scale and (asymmetric) a zero point of its own per output and group."""
    generator = torch.Generator().manual_seed(seed)
    layer = PackedIntLinear(
        in_features, out_features, bias, PackedIntWeights(bits, group, symmetric)
    )
    low = -(1 << (bits - 1))
    num_groups = in_features // (group or in_features)

    def integers(*shape: int) -> torch.Tensor:
        return torch.randint(low, -low, shape, generator=generator, dtype=torch.int8)

    with torch.no_grad():
        layer.weight_packed.copy_(pack_to_int32(integers(out_features, in_features), bits))
        # weights of about the same size for either width: 8-bit steps 16x finer
        scale = (torch.rand(out_features, num_groups, generator=generator) * 0.02 + 0.005) / (
            1 << (bits - 4)
        )
        layer.weight_scale.data = scale.to(dtype)
        if layer.weight_zero_point is not None:
            zero = pack_to_int32(integers(out_features, num_groups), bits, packed_dim=0)
            layer.weight_zero_point.copy_(zero)
        if layer.bias is not None:
            layer.bias.data = torch.randn(out_features, generator=generator).to(dtype)
    return layer.to(DEVICE)


def _torch_path(layer: PackedIntLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's own dequantize-then-matmul, on any device."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "usable", lambda x: False)
        return layer(x)


def _kernel(
    layer: PackedIntLinear, x: torch.Tensor, tiling: MatmulTiling | None = None
) -> torch.Tensor:
    return packed_int_matmul(
        x,
        layer.weight_packed,
        layer.weight_scale,
        layer.weight_zero_point,
        layer.weights.num_bits,
        layer.bias,
        tiling,
    )


def _random_x(num_rows: int, dtype: torch.dtype, in_features: int = IN_FEATURES) -> torch.Tensor:
    return torch.randn(num_rows, in_features, device=DEVICE).to(dtype)


@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 128, None], ids=["g32", "g128", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_equals_the_torch_path_in_float32(
    bits: int, group: int | None, symmetric: bool, num_rows: int
) -> None:
    """The tiles a GPU runs in 16 bits, for decode (1 and 5 rows: 16 x 32, K steps of 128) and
    prefill (33 rows: 64 x 64, steps of 64); groups of 32 (several a step), of 128 (one or two
    steps each) and one per row."""
    layer = _layer(bits, group, symmetric, seed=bits + num_rows)
    torch.manual_seed(num_rows)
    x = _random_x(num_rows, torch.float32)
    got = _kernel(layer, x, default_tiling(num_rows, torch.bfloat16))
    assert got.shape == (num_rows, OUT_FEATURES) and got.dtype == torch.float32
    torch.testing.assert_close(got, _torch_path(layer, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("group", "block_k"),
    [(32, 16), (32, 64), (48, 16), (48, 64), (None, 64)],
    ids=["g32-two-steps-a-group", "g32-two-groups-a-step", "g48-three-steps-a-group",
         "g48-groups-cut-by-steps", "channel-partial-last-step"],
)  # fmt: skip
@pytest.mark.parametrize("bits", [4, 8])
def test_groups_and_k_steps_that_do_not_line_up(bits: int, group: int | None, block_k: int) -> None:
    """160 or 192 inputs (a partial last K step of 64), asymmetric: each input finds its own
    group whether a step holds several groups, part of one, or cuts across two."""
    in_features = 192 if group == 48 else 160
    layer = _layer(bits, group, False, in_features=in_features, seed=block_k)
    x = _random_x(19, torch.float32, in_features)
    for tiling in (MatmulTiling(16, 32, block_k), MatmulTiling(32, 16, block_k)):
        torch.testing.assert_close(
            _kernel(layer, x, tiling), _torch_path(layer, x), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 128)], ids=["w4-g32", "w8-g128"])
@pytest.mark.parametrize("num_rows", [1, 33])
def test_sixteen_bit_dtypes_stay_within_steps_of_the_torch_path(
    dtype: torch.dtype, bits: int, group: int, num_rows: int
) -> None:
    """The weights are the torch path's bits (in float16; the interpreter truncates bfloat16
    ones), so float16 stays within two steps of the output's scale and bfloat16 within four."""
    layer = _layer(bits, group, False, dtype, seed=bits)
    torch.manual_seed(num_rows)
    x = _random_x(num_rows, dtype)
    expected = _torch_path(layer, x).float()
    got = _kernel(layer, x)
    assert got.dtype == dtype
    steps = 2.0 if dtype == torch.float16 else 4.0
    atol = steps * torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_bias_is_added(dtype: torch.dtype) -> None:
    layer = _layer(4, 128, True, dtype, bias=True, seed=3)
    x = _random_x(5, dtype)
    expected = _torch_path(layer, x).float()
    got = _kernel(layer, x).float()
    atol = 4 * torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5)
    assert layer.bias is not None
    without = expected - layer.bias.float()
    assert (got - without).abs().max() > 0.5  # (the bias is N(0, 1))


@pytest.mark.parametrize(
    ("scale_dtype", "x_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float16)]
)
def test_a_scale_of_another_dtype_rounds_the_weights_to_it_first(
    scale_dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    """Each weight rounds to the scale's dtype, then to x's: float16 weights in a float32
    matmul are held to float32's 1e-5 (unrounded ones miss it by ~1e-3)."""
    layer = _layer(8, 32, False, scale_dtype, seed=4)
    x = _random_x(5, x_dtype)
    expected = _torch_path(layer, x).float()
    got = _kernel(layer, x)
    assert got.dtype == x_dtype
    if x_dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        atol = 2 * torch.finfo(x_dtype).eps * expected.abs().max().item()
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


def test_a_strided_x_and_an_empty_batch() -> None:
    layer = _layer(4, 32, False, seed=5)
    wide = _random_x(7, torch.float32, 2 * IN_FEATURES)
    x = wide[:, 1::2]  # column stride 2
    torch.testing.assert_close(_kernel(layer, x), _torch_path(layer, x), atol=1e-5, rtol=1e-5)
    assert _kernel(layer, _random_x(0, torch.float32)).shape == (0, OUT_FEATURES)


def test_default_tiling_decode_and_prefill() -> None:
    assert default_tiling(1, torch.bfloat16) == MatmulTiling(16, 32, 128, num_stages=4)
    assert default_tiling(16, torch.float32).block_k == 32
    assert default_tiling(33, torch.float16) == MatmulTiling(64, 64, 64)
    assert default_tiling(4096, torch.float32) == MatmulTiling(64, 64, 32)


def test_the_layer_takes_the_kernel_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``usable`` says a GPU tensor, the layer's forward runs the kernel (on x's rows,
    whatever its leading dims); on CPU it keeps the torch path."""
    layer = _layer(4, 32, False, bias=True, seed=6)
    x = torch.randn(2, 3, IN_FEATURES, device=DEVICE)
    expected = _torch_path(layer, x)
    calls: list[int] = []
    kernel = kernels.packed_int_matmul

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(kernels, "packed_int_matmul", counted)
    if DEVICE == "cpu":
        layer(x)
        assert calls == []  # a CPU tensor: the torch path
        monkeypatch.setattr(kernels, "usable", lambda x: True)
    got = layer(x)
    assert calls == [6] and got.shape == (2, 3, OUT_FEATURES)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs a CPU model through the interpreter")
def test_greedy_tokens_through_the_kernel_equal_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny W4A16 checkpoint (groups of 32, asymmetric) made by compressed-tensors, every
    projection through the kernel (the interpreter on CPU, as on a GPU): a prefill of two
    prompts, then decode steps of both."""
    model_dir = make_pack_quantized_model(tmp_path, num_bits=4, group_size=32, symmetric=False)
    prompts = [[5, 77, 301, 12, 950, 40], list(range(3, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def greedy() -> list[list[int]]:
        llm = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]

    expected = greedy()
    monkeypatch.setattr(kernels, "usable", lambda x: True)
    assert greedy() == expected


def test_bad_arguments_are_refused_naming_them() -> None:
    layer = _layer(4, 32, False, bias=True, seed=7)
    x = _random_x(3, torch.float32)
    arguments: dict[str, Any] = {
        "x": x,
        "weight_packed": layer.weight_packed,
        "weight_scale": layer.weight_scale,
        "weight_zero_point": layer.weight_zero_point,
        "num_bits": 4,
        "bias": layer.bias,
    }
    scale, zero = layer.weight_scale, layer.weight_zero_point
    assert zero is not None
    for name, bad, message in (
        ("x", x[None], r"x must be \[num_rows, in_features\]"),
        ("x", x.to(torch.int32), "x dtype must be"),
        ("x", x[:, :252], "x's in_features 252 must be a multiple of 8"),
        ("num_bits", 2, "num_bits must be 4 or 8"),
        ("weight_packed", layer.weight_packed[:, :16], r"weight_packed must be \[out_features"),
        ("weight_packed", layer.weight_packed.long(), "weight_packed must be int32"),
        ("weight_scale", scale[:40], r"weight_scale must be \[out_features = 72"),
        ("weight_scale", scale[:, :3], r"weight_scale must be \[out_features = 72"),
        ("weight_scale", scale.to(torch.float64), "weight_scale dtype must be"),
        ("weight_zero_point", zero[:, :4], r"weight_zero_point must be \[out_features / 8"),
        ("weight_zero_point", zero.to(torch.int64), "weight_zero_point must be int32"),
        ("bias", torch.zeros(71, device=DEVICE), r"bias must be a contiguous \[out_features"),
        ("bias", torch.zeros(72, dtype=torch.float16, device=DEVICE), "bias dtype"),
        ("bias", torch.zeros(72, device="meta"), "bias is on meta"),
    ):
        with pytest.raises(ValueError, match=message):
            packed_int_matmul(**{**arguments, name: bad})
    with pytest.raises(ValueError, match="tiling.block_k must be a power of two >= 16"):
        packed_int_matmul(**arguments, tiling=MatmulTiling(16, 32, 8))
