"""The Triton float8 block matmul (engine/kernels/fp8_block_matmul.py) against a torch reference
of the same arithmetic: the inputs quantized per token and group of ``block_cols`` as DeepSeek-V3
and vLLM's ``per_token_group_quant_fp8`` quantize them (float32: largest magnitude at least
1e-10, scale = largest / 448, x / scale clamped to +-448 and rounded to e4m3), then the quantized
inputs times the block-scaled weight summed in float64.

The quantization is held to the reference to the bit (the values and the scales). The weights
span every finite e4m3 code and the scales differ per block by up to 2^6, and the inputs'
magnitudes differ per group by as much, so a wrong group, block or scale moves float32 results
far past the 1e-5 of the output's scale they are held to (2e-3 on a GPU, whose float8 MMA sums
with fewer bits). Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET): shapes stay small. The interpreter rounds float32 to bfloat16 by truncation
(a GPU rounds to nearest even), so 16-bit outputs are held to a few steps of the output's
scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.kernels import fp8_block_matmul as kernels
from engine.kernels.fp8_block_matmul import (
    FP8_MAX,
    GROUP_EPS,
    default_tiling,
    fp8_block_matmul,
    quantize_per_token_group,
)
from engine.kernels.matmul_tiling import MatmulTiling
from engine.quantization.config import Fp8BlockWeights
from engine.quantization.fp8_linear import Fp8BlockLinear
from tests.engine.quantized_runs import quantized_llm
from tests.fixtures.quantized_models import make_fp8_block_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 200 outputs: a partial last block of 128 rows and partial last tiles; 320 inputs: groups of
# 128, 128 and a last one of 64
IN_FEATURES, OUT_FEATURES = 320, 200
BLOCK = (128, 128)
# float32 results, relative to the output's scale: the interpreter sums in float32; sm_90's
# float8 MMA sums a K step with fewer mantissa bits (~14) before the float32 accumulator
FLOAT32_TOLERANCE = 1e-5 if DEVICE == "cpu" else 2e-3


def reference_group_quantize(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, in] float8_e4m3fn, [rows, groups] float32
    """x quantized per row and group of ``group_size`` inputs (the last may be shorter), in
    float32 as vLLM's ``per_token_group_quant_fp8`` computes it."""
    num_rows, num_cols = x.shape
    num_groups = -(-num_cols // group_size)
    padded = F.pad(x.float(), (0, num_groups * group_size - num_cols))
    groups = padded.view(num_rows, num_groups, group_size)
    largest = groups.abs().amax(-1, keepdim=True).clamp(min=GROUP_EPS)
    scale = largest / FP8_MAX  # [rows, groups, 1]
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(num_rows, -1)[:, :num_cols], scale.view(num_rows, num_groups)


def reference_block_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out] float64
    """The quantized inputs times the block-dequantized weight, in float64 (+ bias)."""
    block_rows, block_cols = block_size
    out_features, in_features = weight.shape
    q, scale = reference_group_quantize(x, block_cols)
    inputs = q.double() * scale.double().repeat_interleave(block_cols, 1)[:, :in_features]
    weight_scale = weight_scale_inv.double().repeat_interleave(block_rows, 0)[:out_features]
    weight_scale = weight_scale.repeat_interleave(block_cols, 1)[:, :in_features]
    out = inputs @ (weight.double() * weight_scale).T
    return out if bias is None else out + bias.double()


def _weights(
    out_features: int, in_features: int, block_size: tuple[int, int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 code at random, and a scale per block between 2^-14 and 2^-8."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out_features, in_features), generator=generator)
    codes[(codes & 0x7F) == 0x7F] = 0  # (the NaNs)
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    block_rows, block_cols = block_size
    scale_shape = (-(-out_features // block_rows), -(-in_features // block_cols))
    exponents = torch.rand(scale_shape, generator=generator) * 6 - 14
    return weight.to(DEVICE), torch.exp2(exponents).to(DEVICE)


def _inputs(
    num_rows: int, dtype: torch.dtype, in_features: int = IN_FEATURES, seed: int = 0
) -> torch.Tensor:
    """Normal inputs whose magnitude differs per group of 64 by up to 2^6, with outliers; the
    second row all zeros (its scales: 1e-10 / 448)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator)
    x *= torch.exp2(
        torch.rand(-(-in_features // 64), generator=generator) * 6 - 3
    ).repeat_interleave(64)[:in_features]
    x[:, ::37] *= 20.0
    if num_rows > 1:
        x[1] = 0.0
    return x.to(dtype).to(DEVICE)


def _bias(dtype: torch.dtype, out_features: int = OUT_FEATURES) -> torch.Tensor:
    return (
        torch.randn(out_features, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    )


def _close_in_float32(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    tolerance = FLOAT32_TOLERANCE
    torch.testing.assert_close(got.double(), expected, atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("group_size", [128, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_quantization_is_the_references_to_the_bit(dtype: torch.dtype, group_size: int) -> None:
    x = _inputs(7, dtype)
    q, scale = quantize_per_token_group(x, group_size)
    expected_q, expected_scale = reference_group_quantize(x.cpu(), group_size)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), expected_scale)
    assert scale.shape == (7, -(-IN_FEATURES // group_size))
    assert (q.cpu().float().abs().amax() == FP8_MAX).item()  # each group's largest is +-448


def test_the_quantization_rounds_ties_to_even() -> None:
    """Inputs halfway between e4m3 values, subnormal ones too: with a group whose largest is
    448 the scale is exactly 1, so x itself is rounded."""
    x = torch.zeros(1, 128)
    ties = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 240.0, 432.0])
    x[0, : len(ties)] = ties
    x[0, -1] = FP8_MAX
    q, scale = quantize_per_token_group(x.to(DEVICE), 128)
    assert scale.item() == 1.0
    got = q.cpu().float()[0, : len(ties)].tolist()
    assert got == [1.0, 1.25, 16.0, 20.0, 0.0, 2.0**-8, 240.0, FP8_MAX]


@pytest.mark.parametrize("num_rows", [1, 5, 33])
def test_the_kernel_equals_the_reference_in_float32(num_rows: int) -> None:
    """Decode tiles (1 and 5 rows: 16 x 64) and prefill ones (33 rows: 64 x 128), K steps of a
    group of 128, the last group 64 inputs; a partial last block of output rows."""
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, BLOCK, seed=num_rows)
    x = _inputs(num_rows, torch.float32, seed=num_rows)
    got = fp8_block_matmul(x, weight, scale_inv, BLOCK)
    assert got.shape == (num_rows, OUT_FEATURES) and got.dtype == torch.float32
    _close_in_float32(got, reference_block_matmul(x, weight, scale_inv, BLOCK).to(DEVICE))


@pytest.mark.parametrize(
    ("block_size", "tiling"),
    [((48, 64), MatmulTiling(16, 32, 64)), ((64, 64), MatmulTiling(32, 16, 32)),
     ((128, 128), MatmulTiling(16, 64, 32))],
    ids=["rows-48-cut-tiles", "two-k-steps-a-group-tiles-16", "four-k-steps-a-group"],
)  # fmt: skip
def test_blocks_and_tiles_that_do_not_line_up(
    block_size: tuple[int, int], tiling: MatmulTiling
) -> None:
    """Row blocks of 48 (tiles of 32 outputs cut across them), and K steps shorter than a
    group: each output finds its block's scale, each step its group's."""
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, block_size, seed=block_size[0])
    x = _inputs(19, torch.float32, seed=3)
    got = fp8_block_matmul(x, weight, scale_inv, block_size, tiling=tiling)
    _close_in_float32(got, reference_block_matmul(x, weight, scale_inv, block_size).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 33])
def test_sixteen_bit_dtypes_round_once_to_the_output(dtype: torch.dtype, num_rows: int) -> None:
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, BLOCK, seed=4)
    x = _inputs(num_rows, dtype, seed=num_rows)
    bias = _bias(dtype)
    expected = reference_block_matmul(x, weight, scale_inv, BLOCK, bias).to(DEVICE)
    got = fp8_block_matmul(x, weight, scale_inv, BLOCK, bias)
    assert got.dtype == dtype
    atol = 2 * torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)


def test_the_bias_is_added_in_float32() -> None:
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, BLOCK, seed=5)
    x = _inputs(3, torch.float32, seed=5)
    bias = _bias(torch.float32)
    got = fp8_block_matmul(x, weight, scale_inv, BLOCK, bias)
    _close_in_float32(got, reference_block_matmul(x, weight, scale_inv, BLOCK, bias).to(DEVICE))
    without = reference_block_matmul(x, weight, scale_inv, BLOCK).to(DEVICE)
    assert (got.double() - without).abs().max() > 0.5  # (the bias is N(0, 1))


def test_a_strided_x_and_an_empty_batch() -> None:
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, BLOCK, seed=6)
    wide = _inputs(5, torch.float32, 2 * IN_FEATURES, seed=6)
    x = wide[:, 1::2]  # column stride 2
    got = fp8_block_matmul(x, weight, scale_inv, BLOCK)
    _close_in_float32(got, reference_block_matmul(x, weight, scale_inv, BLOCK).to(DEVICE))
    assert fp8_block_matmul(x[:0], weight, scale_inv, BLOCK).shape == (0, OUT_FEATURES)


def test_default_tiling_decode_and_prefill() -> None:
    assert default_tiling(1, 128) == MatmulTiling(16, 64, 128, num_stages=4)
    assert default_tiling(33, 128) == MatmulTiling(64, 128, 128)
    assert default_tiling(4096, 256).block_k == 128
    assert default_tiling(4096, 64).block_k == 64


def _layer(
    block_size: tuple[int, int], bias: bool, dtype: torch.dtype, seed: int = 0
) -> Fp8BlockLinear:
    layer = Fp8BlockLinear(IN_FEATURES, OUT_FEATURES, bias, Fp8BlockWeights(*block_size))
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, block_size, seed)
    layer = layer.to(dtype)
    layer.keep_quantized_dtypes()
    with torch.no_grad():
        layer.weight.copy_(weight.cpu())
        layer.weight_scale_inv.copy_(scale_inv.cpu())
        if layer.bias is not None:
            layer.bias.copy_(_bias(dtype).cpu())
    return layer.to(DEVICE)


def _dequantizing_path(layer: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's own dequantize-then-matmul, on any device."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "usable", lambda *args: False)
        return layer(x)


def test_the_layer_takes_the_kernel_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``usable`` says a GPU tensor, the layer's forward runs the kernel (on x's rows,
    whatever its leading dims) to the reference's arithmetic; on CPU it keeps the dequantizing
    path, which the kernel's float8 inputs stay within a few percent of."""
    layer = _layer(BLOCK, True, torch.float32, seed=7)
    x = _inputs(6, torch.float32, seed=7).view(2, 3, IN_FEATURES)
    calls: list[int] = []
    kernel = kernels.fp8_block_matmul

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(kernels, "fp8_block_matmul", counted)
    if DEVICE == "cpu":
        dequantized = layer(x)
        assert calls == []  # a CPU tensor: the dequantizing path
        monkeypatch.setattr(kernels, "usable", lambda *args: True)
    else:
        dequantized = _dequantizing_path(layer, x)
    got = layer(x)
    assert calls == [6] and got.shape == (2, 3, OUT_FEATURES)
    expected = reference_block_matmul(
        x.reshape(6, -1).cpu(), layer.weight.cpu(), layer.weight_scale_inv.cpu(), BLOCK,
        layer.bias.cpu() if layer.bias is not None else None,
    )  # fmt: skip
    _close_in_float32(got.reshape(6, -1), expected.to(DEVICE))
    error = (got - dequantized).norm() / dequantized.norm()
    assert error < 0.05, error  # float8 inputs: a relative 2^-4 at most, ~2^-6 on average


def test_blocks_the_kernels_cannot_run_keep_the_dequantizing_path() -> None:
    x = torch.zeros(1, 256, device="cuda" if torch.cuda.is_available() else "meta")
    assert kernels.usable(x, (128, 128)) == torch.cuda.is_available()
    assert not kernels.usable(x, (128, 96))  # columns not a power of two
    assert not kernels.usable(x, (128, 16))  # below an 8-bit MMA's 32 inputs
    assert not kernels.usable(torch.zeros(1, 256), (128, 128))  # CPU


def test_bad_arguments_are_refused_naming_them() -> None:
    weight, scale_inv = _weights(OUT_FEATURES, IN_FEATURES, BLOCK, seed=8)
    x = _inputs(3, torch.float32, seed=8)
    arguments: dict[str, Any] = {
        "x": x,
        "weight": weight,
        "weight_scale_inv": scale_inv,
        "block_size": BLOCK,
        "bias": _bias(torch.float32),
    }
    for name, bad, message in (
        ("x", x[None], r"x must be \[num_rows, in_features\]"),
        ("x", x.to(torch.int32), "x dtype must be"),
        ("weight", weight[:, :256], r"weight must be \[out_features, in_features = 320\]"),
        ("weight", weight.view(torch.int8), "weight must be float8_e4m3fn"),
        ("weight", weight.t().contiguous().t(), "weight's rows must be contiguous"),
        ("weight_scale_inv", scale_inv[:1], r"weight_scale_inv must be \[ceil\(out_features"),
        ("weight_scale_inv", scale_inv.double(), "weight_scale_inv dtype must be"),
        ("block_size", (128, 96), r"block_size\[1\] \(inputs a scale covers\) must be a power"),
        ("block_size", (0, 128), r"block_size\[0\] \(rows a scale covers\) must be >= 1"),
        ("bias", torch.zeros(199, device=DEVICE), r"bias must be a contiguous float"),
        ("bias", torch.zeros(200, device="meta"), "bias is on meta"),
    ):
        with pytest.raises(ValueError, match=message):
            fp8_block_matmul(**{**arguments, name: bad})
    with pytest.raises(ValueError, match="tiling.block_k must be a power of two >= 32"):
        fp8_block_matmul(**arguments, tiling=MatmulTiling(16, 32, 16))
    with pytest.raises(ValueError, match=r"tiling.block_k 256 must divide block_size\[1\] 128"):
        fp8_block_matmul(**arguments, tiling=MatmulTiling(16, 32, 256))
    with pytest.raises(ValueError, match="group_size must be a power of two >= 32"):
        quantize_per_token_group(x, 100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_the_layers_cuda_path_stays_near_its_cpu_path(num_rows: int) -> None:
    """DeepSeek-V3-like widths in bfloat16 (7168 inputs, 1536 outputs: q_a_proj's) on the GPU:
    the kernels' quantization equal to the reference's bits, their product to the reference's
    within bfloat16's rounding, and within float8 inputs' error of the CPU's dequantizing path
    on the same weights."""
    in_features, out_features = 7168, 1536
    layer = Fp8BlockLinear(in_features, out_features, False, Fp8BlockWeights(*BLOCK))
    weight, scale_inv = _weights(out_features, in_features, BLOCK, seed=num_rows)
    with torch.no_grad():
        layer.weight.copy_(weight.cpu())
        layer.weight_scale_inv.copy_(scale_inv.cpu())
    x = _inputs(num_rows, torch.bfloat16, in_features, seed=num_rows)  # on the GPU
    q, scale = quantize_per_token_group(x, BLOCK[1])
    expected_q, expected_scale = reference_group_quantize(x.cpu(), BLOCK[1])
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), expected_scale)
    cpu_path = layer(x.cpu()).double()  # the dequantizing path
    got = layer.to("cuda")(x)
    assert got.dtype == torch.bfloat16
    expected = reference_block_matmul(x.cpu(), weight.cpu(), scale_inv.cpu(), BLOCK)
    atol = 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), expected, atol=atol, rtol=0)
    error = (got.cpu().double() - cpu_path).norm() / cpu_path.norm()
    assert error < 0.05, error
    assert torch.equal(got, layer(x))  # the same bits on a second run


@pytest.mark.skipif(DEVICE == "cuda", reason="runs a CPU model through the interpreter")
def test_greedy_tokens_through_the_kernels_equal_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny FP8 checkpoint (blocks of 128) with every projection through the kernels (the
    interpreter on CPU, as on a GPU), and through the torch reference of the same arithmetic:
    a prefill of two prompts, then decode steps of both."""
    model_dir = make_fp8_block_model(tmp_path, num_key_value_heads=4)
    prompts = [[5, 77, 301, 12, 950, 40], list(range(3, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def greedy() -> list[list[int]]:
        llm = quantized_llm(model_dir)
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]

    calls = {"kernel": 0, "reference": 0}
    kernel = kernels.fp8_block_matmul

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls["kernel"] += 1
        return kernel(x, *args)

    def reference(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls["reference"] += 1
        return reference_block_matmul(x, *args).to(x.dtype)

    monkeypatch.setattr(kernels, "usable", lambda *args: True)
    monkeypatch.setattr(kernels, "fp8_block_matmul", counted)
    got = greedy()
    monkeypatch.setattr(kernels, "fp8_block_matmul", reference)
    assert got == greedy()
    assert calls["kernel"] == calls["reference"] > 0
