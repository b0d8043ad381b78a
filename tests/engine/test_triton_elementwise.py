"""The Triton elementwise kernels (engine/kernels/elementwise.py) against the model's torch code
for the same step: in Triton's interpreter on CPU here, at full size on a GPU (marked ``gpu``).

The interpreter rounds float32 to bfloat16 by truncation (a GPU rounds to nearest even), so
here bfloat16 results are held to one bfloat16 step; float32 and float16 are held to what the
kernels promise everywhere: the same bits as torch, except where a sum's order or exp differ.
The GPU tests hold bfloat16 to the same bits as torch on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.kernels import elementwise as triton_kernels
from engine.kernels.cpu import elementwise as cpu_kernels
from engine.models import fused_ops
from engine.models.fused_ops import torch_silu_and_mul
from engine.models.rms_norm import torch_rms_norm
from engine.models.rope import apply_rotary
from tests.engine.test_parity import greedy_params, make_prompts, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# one step of the dtype at magnitude ~4 (norms and SiLU land there), and float32's sum order
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 3.2e-2, "rtol": 1.6e-2},
}


def _random(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 256), (1, 96), (3, 5, 64)])
def test_rms_norm_matches_torch(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, weight = _random(*shape, dtype=dtype, scale=3.0), _random(shape[-1], dtype=dtype)
    got = triton_kernels.rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])


def test_rms_norm_of_a_strided_view() -> None:
    """Qwen3's per-head q/k norms see a view into the qkv projection's output."""
    torch.manual_seed(1)
    qkv = _random(5, 3 * 4 * 16, dtype=torch.float32)
    query = qkv[:, : 4 * 16].view(5, 4, 16)
    weight = _random(16, dtype=torch.float32)
    expected = torch_rms_norm(query, weight, 1e-5)
    torch.testing.assert_close(triton_kernels.rms_norm(query, weight, 1e-5), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    residual, x = _random(9, 200, dtype=dtype), _random(9, 200, dtype=dtype)
    weight = _random(200, dtype=dtype)
    total, normed = triton_kernels.add_rms_norm(residual, x, weight, 1e-6)
    if dtype == torch.bfloat16:  # the interpreter's bfloat16 rounding (module docstring)
        torch.testing.assert_close(total, residual + x, **TOLERANCE[dtype])
    else:
        assert torch.equal(total, residual + x)
    torch.testing.assert_close(normed, torch_rms_norm(total, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (6, 2, 32), (3, 1, 24)]
)
def test_rotary_in_place_matches_apply_rotary(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """q and k as views of one fused qkv row (strided tokens), GQA, a head_dim whose half is
    not a power of two; v is left alone."""
    torch.manual_seed(3)
    num_tokens = 11
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = _random(num_tokens, sum(sizes), dtype=dtype)
    q, k, v = qkv.split(sizes, dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    # as RotaryEmbedding hands them over: one [tokens, head_dim] table, chunked in two
    angles = torch.randn(num_tokens, head_dim // 2, device=DEVICE) * 3
    table = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    cos, sin = table[:, None, :].chunk(2, dim=-1)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    untouched_v = v.clone()
    triton_kernels.rotary_(q, k, cos, sin)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
        torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])
    else:  # every product and sum rounds where torch's does: the same bits
        assert torch.equal(q, expected_q)
        assert torch.equal(k, expected_k)
    assert torch.equal(v, untouched_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [688, 2500])  # one program per row, and several
def test_silu_and_mul_matches_torch(dim: int, dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    gate_up = _random(6, 2 * dim, dtype=dtype, scale=4.0)
    got = triton_kernels.silu_and_mul(gate_up)
    assert got.shape == (6, dim)
    torch.testing.assert_close(got, torch_silu_and_mul(gate_up), **TOLERANCE[dtype])


def test_empty_batches_launch_nothing() -> None:
    weight = _random(32, dtype=torch.float32)
    assert triton_kernels.rms_norm(torch.empty(0, 32, device=DEVICE), weight, 1e-6).shape == (0, 32)
    assert triton_kernels.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
    q, k = torch.empty(0, 4, 8, device=DEVICE), torch.empty(0, 2, 8, device=DEVICE)
    cos = sin = torch.empty(0, 1, 4, device=DEVICE)
    triton_kernels.rotary_(q, k, cos, sin)


def test_bad_arguments_are_refused_naming_them() -> None:
    x = _random(3, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight must be \[16\] of x's dtype"):
        triton_kernels.rms_norm(x, _random(16, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        triton_kernels.add_rms_norm(_random(3, 8, dtype=torch.float32), x, x[0], 1e-6)
    strided = _random(3, 8, 4, dtype=torch.float32).transpose(1, 2)  # [3, 4, 8], strided heads
    cos = sin = _random(3, 1, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="query's heads must be contiguous"):
        triton_kernels.rotary_(strided, _random(3, 4, 8, dtype=torch.float32), cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        triton_kernels.rotary_(
            _random(3, 4, 8, dtype=torch.float32), strided.contiguous(), cos[:2], sin
        )
    with pytest.raises(ValueError, match="gate_up's last dim must be even"):
        triton_kernels.silu_and_mul(_random(2, 7, dtype=torch.float32))


def test_the_model_picks_triton_on_a_gpu_and_c_on_cpu() -> None:
    assert not triton_kernels.usable(torch.zeros(2, 4))
    assert fused_ops.kernels_for(torch.zeros(2, 4)) is cpu_kernels
    assert fused_ops.kernels_for(torch.zeros(2, 4, dtype=torch.bfloat16)) is cpu_kernels
    assert fused_ops.kernels_for(torch.zeros(2, 4, dtype=torch.float16)) is None
    if torch.cuda.is_available():
        assert fused_ops.kernels_for(torch.zeros(2, 4, device="cuda")) is triton_kernels


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_matches_transformers_through_the_triton_kernels(
    model_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model with every elementwise step in a Triton kernel (the interpreter on CPU), as on
    a GPU; Qwen3 adds the per-head q/k norms."""
    monkeypatch.setattr(cpu_kernels, "usable", lambda x: False)
    monkeypatch.setattr(triton_kernels, "usable", lambda x: True)
    model_dir = model_dirs[arch]
    prompts = make_prompts(seed=1)
    expected = reference(model_dir, prompts, "plain")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    # half the requests: the interpreter runs each kernel program in Python
    outputs = llm.generate(prompts[::2], greedy_params()[::2])
    assert [o.outputs[0].token_ids for o in outputs] == expected[::2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bfloat16_bits_match_torch_on_gpu() -> None:
    """Llama-3-8B sizes in bfloat16: rotary and the residual add give torch's bits; the norms
    and SiLU * up at most one bfloat16 step from torch (the RMS sum's order, exp)."""
    torch.manual_seed(5)
    dtype, tokens = torch.bfloat16, 64
    qkv = _random(tokens, (32 + 2 * 8) * 128, dtype=dtype)
    q = qkv[:, : 32 * 128].view(tokens, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128)
    angles = torch.randn(tokens, 64, device=DEVICE) * 100
    cos, sin = torch.cat((angles.cos(), angles.sin()), -1).to(dtype)[:, None, :].chunk(2, -1)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    triton_kernels.rotary_(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    residual, x = _random(tokens, 4096, dtype=dtype), _random(tokens, 4096, dtype=dtype)
    weight = _random(4096, dtype=dtype)
    total, normed = triton_kernels.add_rms_norm(residual, x, weight, 1e-5)
    assert torch.equal(total, residual + x)
    torch.testing.assert_close(normed, torch_rms_norm(total, weight, 1e-5), **TOLERANCE[dtype])
    gate_up = _random(tokens, 2 * 14336, dtype=dtype, scale=4.0)
    silu = triton_kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(silu, torch_silu_and_mul(gate_up), **TOLERANCE[dtype])
