"""The Triton W8A8 kernels (engine/kernels/scaled_matmul.py): the inputs' quantization held to
``w8a8_linear``'s torch functions to the bit (per token, per token with a row-parallel layer's
whole-row magnitude, and with a static scale), and the 8-bit matmul against the quantized
operands times their scales summed in float64.

The weights span their type's whole range (every int8, every finite e4m3 code) with a scale of
their own per output row, and the inputs' magnitudes differ per row, so a wrong scale, row or
rounding moves float32 results far past the 1e-5 of the output's scale they are held to (float8
on a GPU: 2e-3, its MMA sums with fewer bits). Without CUDA the kernels run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET): shapes stay small. The interpreter rounds
float32 to bfloat16 by truncation (a GPU rounds to nearest even), so 16-bit outputs are held to
a few steps of the output's scale.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kernels.matmul_tiling import MatmulTiling
from engine.kernels.scaled_matmul import (
    ELEMENT_DTYPES,
    KINDS,
    default_tiling,
    quantize_rows,
    scaled_matmul,
    torch_scaled_mm_usable,
    w8a8_matmul,
)
from engine.quantization.w8a8_linear import quantize_per_token, quantize_with_scale

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN_FEATURES, OUT_FEATURES = 320, 200  # partial last K steps of 128 and output tiles of 64 / 128
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32 results, relative to the output's scale: int8 sums are exact and the interpreter sums
# float8 in float32; sm_90's float8 MMA sums a K step with fewer mantissa bits (~14)
FLOAT32_TOLERANCE = {"int": 1e-5, "float": 1e-5 if DEVICE == "cpu" else 2e-3}


def reference_scaled_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out] float64, on the CPU
    """The quantized inputs times the dequantized weight, in float64 (+ bias)."""
    inputs = x_q.cpu().double() * x_scale.cpu().double()
    out = inputs @ (weight.cpu().double() * weight_scale.cpu().double()).T
    return out if bias is None else out + bias.cpu().double()


def _weights(
    kind: str, scale_dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every int8 / finite e4m3 value at random, and a scale per output between 2^-12 and 2^-6
    (int8) or 2^-14 and 2^-8 (float8, whose values reach 448)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (OUT_FEATURES, IN_FEATURES), generator=generator)
    if kind == "float":
        codes[(codes & 0x7F) == 0x7F] = 0  # (the NaNs)
    weight = codes.to(torch.uint8).view(ELEMENT_DTYPES[kind])
    lowest = -12.0 if kind == "int" else -14.0
    scale = torch.exp2(torch.rand(OUT_FEATURES, 1, generator=generator) * 6 + lowest)
    return weight.to(DEVICE), scale.to(scale_dtype).to(DEVICE)


def _inputs(
    num_rows: int, dtype: torch.dtype, in_features: int = IN_FEATURES, seed: int = 0
) -> torch.Tensor:
    """Normal inputs whose magnitude differs per row by up to 2^8, with outliers; the second
    row all zeros (its scale: the dtype's eps)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator)
    x *= torch.exp2(torch.rand(num_rows, 1, generator=generator) * 8 - 4)
    x[:, ::37] *= 20.0
    if num_rows > 1:
        x[1] = 0.0
    return x.to(dtype).to(DEVICE)


def _bias(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(9)
    return torch.randn(OUT_FEATURES, generator=generator).to(dtype).to(DEVICE)


def _close_in_float32(got: torch.Tensor, expected: torch.Tensor, kind: str) -> None:
    scale, tolerance = expected.abs().max().item(), FLOAT32_TOLERANCE[kind]
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance * scale, rtol=tolerance)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.cpu().to(dtype) * scale.cpu().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_per_token_quantization_is_quantize_per_token_to_the_bit(
    kind: str, dtype: torch.dtype
) -> None:
    """Each step in x's dtype as torch computes it: q * scale is ``quantize_per_token``'s
    output exactly, and each row's largest magnitude lands on the type's half range (int8:
    127.5, clamped to 127 or rounded to -128)."""
    x = _inputs(7, dtype)
    q, scale = quantize_rows(x, kind)
    assert q.dtype == ELEMENT_DTYPES[kind] and scale.shape == (7, 1)
    assert scale.dtype == torch.float32
    expected = quantize_per_token(x.cpu(), kind)
    assert torch.equal(_dequantized(q, scale, dtype), expected)
    assert scale[1].item() == torch.finfo(dtype).eps  # the row of zeros
    if kind == "int":
        assert q.cpu().int().min() == -128 or q.cpu().int().max() == 127


@pytest.mark.parametrize("kind", KINDS)
def test_a_given_largest_magnitude_scales_the_row_as_the_whole_rows(kind: str) -> None:
    """A row-parallel rank's share of the features, quantized with the whole row's largest
    magnitude: the whole row's quantization, on this rank's columns."""
    whole = _inputs(5, torch.bfloat16, 2 * IN_FEATURES, seed=1)
    whole[:, IN_FEATURES:] *= 4.0  # the other rank's share holds the largest magnitudes
    largest = whole.abs().amax(-1, keepdim=True)
    share = whole[:, :IN_FEATURES]
    q, scale = quantize_rows(share, kind, row_largest=largest)
    expected = quantize_per_token(whole.cpu(), kind)[:, :IN_FEATURES]
    assert torch.equal(_dequantized(q, scale, torch.bfloat16), expected)


@pytest.mark.parametrize(
    ("x_dtype", "scale_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
     (torch.float32, torch.float32), (torch.float16, torch.float16)],
)  # fmt: skip
@pytest.mark.parametrize("kind", KINDS)
def test_a_static_scale_is_quantize_with_scale_to_the_bit(
    kind: str, x_dtype: torch.dtype, scale_dtype: torch.dtype
) -> None:
    """Every row with one scale, small enough that the largest inputs clamp; in x's dtype, or
    in float32 where the scale is float32 and x is not (torch's promotion)."""
    x = _inputs(6, x_dtype, seed=2)
    input_scale = torch.tensor([0.01], dtype=scale_dtype, device=DEVICE)
    q, scale = quantize_rows(x, kind, input_scale=input_scale)
    assert torch.equal(scale.cpu(), input_scale.cpu().float().expand(6, 1))
    expected = quantize_with_scale(x.cpu(), input_scale.cpu(), kind)
    assert torch.equal(q.cpu().to(scale_dtype) * input_scale.cpu(), expected)
    high = 127 if kind == "int" else 448
    assert q.cpu().float().max() == high  # (some inputs clamp)


def test_int8_rounds_half_to_even_and_clamps_to_minus_128() -> None:
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -127.5, -128.5, 300.0, -300.0]])
    q, _ = quantize_rows(x.to(DEVICE), "int", input_scale=torch.ones(1, device=DEVICE))
    assert q.cpu().tolist() == [[0, 2, 2, 0, -2, 126, 127, -128, -128, 127, -128]]


@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_equals_the_reference_in_float32(kind: str, num_rows: int) -> None:
    """Decode tiles (1 and 5 rows: 16 x 64) and prefill ones (33 rows: 64 x 128), K steps of
    128 with a partial last one: int8 summed exactly in int32, float8 in float32."""
    weight, weight_scale = _weights(kind, seed=num_rows)
    x = _inputs(num_rows, torch.float32, seed=num_rows)
    got = w8a8_matmul(x, weight, weight_scale, kind)
    assert got.shape == (num_rows, OUT_FEATURES) and got.dtype == torch.float32
    q, scale = quantize_rows(x, kind)
    _close_in_float32(got, reference_scaled_matmul(q, scale, weight, weight_scale), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_other_tilings(kind: str) -> None:
    weight, weight_scale = _weights(kind, seed=3)
    x = _inputs(19, torch.float32, seed=3)
    q, scale = quantize_rows(x, kind)
    expected = reference_scaled_matmul(q, scale, weight, weight_scale)
    for tiling in (MatmulTiling(16, 32, 32), MatmulTiling(32, 16, 64)):
        got = scaled_matmul(q, scale, weight, weight_scale, x.dtype, None, tiling)
        _close_in_float32(got, expected, kind)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_sixteen_bit_dtypes_round_once_to_the_output(kind: str, dtype: torch.dtype) -> None:
    """x, weight scales and bias in the model's dtype (a model cast to it): one rounding of the
    float32 result, a few steps of the output's scale."""
    weight, weight_scale = _weights(kind, dtype, seed=4)
    x = _inputs(33, dtype, seed=4)
    bias = _bias(dtype)
    got = w8a8_matmul(x, weight, weight_scale, kind, bias)
    assert got.dtype == dtype
    q, scale = quantize_rows(x, kind)
    expected = reference_scaled_matmul(q, scale, weight, weight_scale, bias)
    atol = 2 * torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_the_bias_is_added_in_float32(kind: str) -> None:
    weight, weight_scale = _weights(kind, seed=5)
    x = _inputs(3, torch.float32, seed=5)
    bias = _bias(torch.float32)
    got = w8a8_matmul(x, weight, weight_scale, kind, bias)
    q, scale = quantize_rows(x, kind)
    _close_in_float32(got, reference_scaled_matmul(q, scale, weight, weight_scale, bias), kind)
    without = reference_scaled_matmul(q, scale, weight, weight_scale)
    assert (got.cpu().double() - without).abs().max() > 0.5  # (the bias is N(0, 1))


def test_a_strided_x_and_an_empty_batch() -> None:
    weight, weight_scale = _weights("int", seed=6)
    wide = _inputs(5, torch.float32, 2 * IN_FEATURES, seed=6)
    x = wide[:, 1::2]  # column stride 2
    q, scale = quantize_rows(x, "int")
    assert torch.equal(_dequantized(q, scale, x.dtype), quantize_per_token(x.cpu(), "int"))
    got = w8a8_matmul(x, weight, weight_scale, "int")
    _close_in_float32(got, reference_scaled_matmul(q, scale, weight, weight_scale), "int")
    assert w8a8_matmul(x[:0], weight, weight_scale, "int").shape == (0, OUT_FEATURES)


def test_default_tiling_decode_and_prefill() -> None:
    assert default_tiling(1) == MatmulTiling(16, 64, 128, num_stages=4)
    assert default_tiling(33) == MatmulTiling(64, 128, 128)
    assert default_tiling(4096) == MatmulTiling(64, 128, 128)


def test_torch_scaled_mm_only_where_it_runs() -> None:
    """Only float8 on a CUDA sm_90 with a bfloat16 output (and widths of 16s) go to torch."""
    x_q = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    weight = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    assert not torch_scaled_mm_usable(x_q, weight, torch.bfloat16)  # CPU
    if torch.cuda.is_available():
        x_q, weight = x_q.cuda(), weight.cuda()
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert torch_scaled_mm_usable(x_q, weight, torch.bfloat16) == hopper
        assert not torch_scaled_mm_usable(x_q, weight, torch.float16)
        assert not torch_scaled_mm_usable(x_q.view(torch.int8), weight, torch.bfloat16)
        assert not torch_scaled_mm_usable(x_q[:, :40], weight[:, :40], torch.bfloat16)


def test_bad_arguments_are_refused_naming_them() -> None:
    weight, weight_scale = _weights("int", seed=8)
    x = _inputs(3, torch.float32, seed=8)
    q, scale = quantize_rows(x, "int")
    arguments: dict[str, Any] = {
        "x_q": q,
        "x_scale": scale,
        "weight": weight,
        "weight_scale": weight_scale,
        "out_dtype": torch.float32,
        "bias": _bias(torch.float32),
    }
    for name, bad, message in (
        ("x_q", q[None], r"x_q must be \[num_rows, in_features\]"),
        ("x_q", q.short(), "x_q dtype must be one of"),
        ("x_q", q.t().contiguous().t(), "x_q's rows must be contiguous"),
        ("x_scale", scale.double(), r"x_scale must be float32 \[num_rows = 3, 1\]"),
        ("x_scale", scale[:2], r"x_scale must be float32 \[num_rows = 3, 1\]"),
        ("weight", weight[:, :256], r"weight must be \[out_features, in_features = 320\]"),
        ("weight", weight.view(torch.float8_e4m3fn), "weight dtype torch.float8_e4m3fn != x_q's"),
        ("weight_scale", weight_scale[:10], r"weight_scale must be a float \[out_features = 200"),
        ("out_dtype", torch.int32, "out_dtype must be one of"),
        ("bias", torch.zeros(199, device=DEVICE), r"bias must be a contiguous float"),
        ("bias", torch.zeros(200, device="meta"), "bias is on meta"),
    ):
        with pytest.raises(ValueError, match=message):
            scaled_matmul(**{**arguments, name: bad})
    with pytest.raises(ValueError, match="tiling.block_k must be a power of two >= 32"):
        scaled_matmul(**arguments, tiling=MatmulTiling(16, 32, 16))
    with pytest.raises(ValueError, match="kind must be one of"):
        w8a8_matmul(x, weight, weight_scale, "int4")
    with pytest.raises(ValueError, match="weight must be torch.float8_e4m3fn for kind 'float'"):
        w8a8_matmul(x, weight, weight_scale, "float")
    with pytest.raises(ValueError, match=r"row_largest must be \[num_rows = 3, 1\]"):
        quantize_rows(x, "int", row_largest=x[:, :1].double())
    with pytest.raises(ValueError, match="input_scale must be one float"):
        quantize_rows(x, "int", input_scale=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="give one at most"):
        quantize_rows(x, "int", x[:, :1], torch.ones(1, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 7, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_at_real_widths_on_gpu(kind: str, num_rows: int) -> None:
    """4096 inputs, 1024 outputs in bfloat16: the quantization equal to ``quantize_per_token``
    on the CPU to the bit; the product (float8: torch's ``_scaled_mm`` on sm_90, and the
    Triton kernel) within bfloat16's rounding of the reference; the same bits on a rerun."""
    in_features, out_features = 4096, 1024
    generator = torch.Generator().manual_seed(num_rows)
    codes = torch.randint(0, 256, (out_features, in_features), generator=generator)
    if kind == "float":
        codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.to(torch.uint8).view(ELEMENT_DTYPES[kind]).cuda()
    weight_scale = torch.exp2(torch.rand(out_features, 1, generator=generator) * 6 - 14)
    weight_scale = weight_scale.to(torch.bfloat16).cuda()
    x = _inputs(num_rows, torch.bfloat16, in_features, seed=num_rows)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16).cuda()
    q, scale = quantize_rows(x, kind)
    assert torch.equal(_dequantized(q, scale, x.dtype), quantize_per_token(x.cpu(), kind))
    expected = reference_scaled_matmul(q, scale, weight, weight_scale, bias)
    atol = 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    runs = {"triton": False}
    if kind == "float" and torch.cuda.get_device_capability()[0] == 9:
        assert torch_scaled_mm_usable(q, weight, torch.bfloat16)
        runs["torch _scaled_mm"] = True
    for label, allow_torch in runs.items():
        got = scaled_matmul(q, scale, weight, weight_scale, x.dtype, bias, allow_torch=allow_torch)
        assert got.dtype == torch.bfloat16, label
        torch.testing.assert_close(got.cpu().double(), expected, atol=atol, rtol=0, msg=label)
        again = scaled_matmul(
            q, scale, weight, weight_scale, x.dtype, bias, allow_torch=allow_torch
        )
        assert torch.equal(got, again), label
    got = w8a8_matmul(x, weight, weight_scale, kind, bias)
    torch.testing.assert_close(got.cpu().double(), expected, atol=atol, rtol=0)
