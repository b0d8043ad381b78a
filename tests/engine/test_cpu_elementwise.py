"""The C elementwise kernels (engine/kernels/cpu/elementwise.c) against the model's torch
path for the same step, and the model's greedy tokens with the kernels off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.kernels.cpu import elementwise as cpu_kernels
from engine.models.fused_ops import torch_silu_and_mul
from engine.models.rms_norm import RMSNorm, torch_rms_norm
from engine.models.rope import apply_rotary
from tests.engine.test_parity import engine_tokens, make_prompts, reference

FLOAT32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "usable", lambda x: False)


def test_kernels_are_taken_for_float32_and_bfloat16_on_cpu() -> None:
    assert cpu_kernels.usable(torch.zeros(2, 4))
    assert cpu_kernels.usable(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not cpu_kernels.usable(torch.zeros(2, 4, dtype=torch.float16))


def test_bfloat16_bits_are_torchs() -> None:
    """Each step rounds where torch's bfloat16 ops round: rope and the residual sum give torch's
    bits, the norm and SiLU * up at most one bfloat16 step from them (the sum of squares'
    order, exp) and, on these draws, none."""
    torch.manual_seed(5)
    bf16 = torch.bfloat16
    q, k = torch.randn(11, 4, 64).to(bf16), torch.randn(11, 2, 64).to(bf16)
    angles = torch.randn(11, 1, 32) * 100
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    cpu_kernels.rotary_(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    residual, x = torch.randn(64, 1024).to(bf16), (torch.randn(64, 1024) * 3).to(bf16)
    weight = torch.randn(1024).to(bf16)
    total, normed = cpu_kernels.add_rms_norm(residual, x, weight, 1e-6)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, torch_rms_norm(total, weight, 1e-6))
    assert torch.equal(cpu_kernels.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    gate_up = (torch.randn(64, 2 * 512) * 4).to(bf16)
    assert torch.equal(cpu_kernels.silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


@pytest.mark.parametrize("shape", [(7, 256), (3, 5, 64), (1, 48)])
def test_rms_norm_matches_torch(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = torch.randn(*shape) * 3
    fused = norm(x)
    monkeypatch.setattr(cpu_kernels, "usable", lambda x: False)
    torch.testing.assert_close(fused, norm(x), **FLOAT32)


def test_rms_norm_of_a_strided_view() -> None:
    """Qwen3's per-head q/k norms see a view into the qkv projection's output."""
    torch.manual_seed(1)
    qkv = torch.randn(5, 3 * 4 * 16)
    query = qkv[:, : 4 * 16].view(5, 4, 16)
    weight = torch.randn(16)
    expected = weight * (query * torch.rsqrt(query.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(cpu_kernels.rms_norm(query, weight, 1e-5), expected, **FLOAT32)


def test_add_rms_norm_returns_the_sum_and_its_norm() -> None:
    torch.manual_seed(2)
    residual, x, weight = torch.randn(9, 128), torch.randn(9, 128), torch.randn(128)
    total, normed = cpu_kernels.add_rms_norm(residual, x, weight, 1e-6)
    assert torch.equal(total, residual + x)  # the same float add, bit for bit
    expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(normed, expected, **FLOAT32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (6, 2, 32)])
def test_rotary_in_place_matches_apply_rotary(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(3)
    num_tokens = 11
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes))
    q, k, v = qkv.split(sizes, dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    angles = torch.randn(num_tokens, 1, head_dim // 2)
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    untouched_v = v.clone()
    cpu_kernels.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, **FLOAT32)
    torch.testing.assert_close(k, expected_k, **FLOAT32)
    assert torch.equal(v, untouched_v)


def test_rotary_refuses_heads_that_are_not_contiguous() -> None:
    q = torch.randn(3, 8, 4).transpose(1, 2)  # [3, 4, 8] with strided heads
    cos = sin = torch.ones(3, 1, 4)
    with pytest.raises(ValueError, match="query's heads must be contiguous"):
        cpu_kernels.rotary_(q, torch.randn(3, 4, 8), cos, sin)


def test_silu_and_mul_matches_torch() -> None:
    torch.manual_seed(4)
    gate_up = torch.randn(6, 2 * 688) * 4
    gate, up = gate_up.split(688, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up, **FLOAT32)


def test_silu_is_within_a_few_ulp_across_the_float_range() -> None:
    """SiLU's exp is a polynomial (vectorised): within 3 ulp of the exact value wherever the
    result is a normal float, and NaN stays NaN."""
    gate = torch.cat([torch.linspace(-85, 85, 200_001), torch.randn(100_000) * 3])
    got = cpu_kernels.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    exact = gate.double() / (1 + torch.exp(-gate.double()))
    normal = exact.abs() > torch.finfo(torch.float32).tiny
    relative = ((got.double() - exact).abs() / exact.abs())[normal]
    assert relative.max() < 3 * 2**-23, relative.max()
    nan = cpu_kernels.silu_and_mul(torch.tensor([[float("nan"), 1.0]]))
    assert nan.isnan().all()


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_rows_shared_over_threads_change_no_bit(torch_threads: None) -> None:
    """Past the size where rows are shared out over torch's threads, every kernel gives the
    same bits as on one thread."""
    torch.manual_seed(5)
    rows = 1100  # x 256 floats or more: past the kernels' threshold for sharing rows out
    residual, x, weight = torch.randn(rows, 256), torch.randn(rows, 256), torch.randn(256)
    gate_up = torch.randn(rows, 2 * 704) * 4
    qkv = torch.randn(rows, 12, 64)
    cos, sin = torch.randn(rows, 1, 32), torch.randn(rows, 1, 32)

    def run() -> list[torch.Tensor]:
        q, k = qkv[:, :8].clone(), qkv[:, 8:].clone()
        cpu_kernels.rotary_(q, k, cos, sin)
        total, normed = cpu_kernels.add_rms_norm(residual, x, weight, 1e-5)
        return [
            cpu_kernels.rms_norm(x, weight, 1e-5),
            total,
            normed,
            q,
            k,
            cpu_kernels.silu_and_mul(gate_up),
        ]

    torch.set_num_threads(1)
    alone = run()
    torch.set_num_threads(3)
    shared = run()
    for a, b in zip(alone, shared, strict=True):
        assert torch.equal(a, b)
    gate, up = gate_up.split(704, dim=-1)
    torch.testing.assert_close(shared[-1], F.silu(gate) * up, **FLOAT32)


def test_greedy_matches_transformers_with_the_kernels_off(
    llama_dir: Path, kernels_off: None
) -> None:
    """The torch path beside each kernel stays exact too (it is what GPUs and bf16 run)."""
    prompts = make_prompts(seed=1)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    assert engine_tokens(llm, prompts) == reference(llama_dir, prompts, "plain")


def test_without_a_compiler_the_model_keeps_its_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.kernels.cpu import build

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    build.load.cache_clear()
    cpu_kernels._library.cache_clear()
    try:
        assert not cpu_kernels.usable(torch.zeros(2, 4))
        norm = RMSNorm(4, 1e-6)
        x = torch.randn(2, 4)
        torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    finally:
        build.load.cache_clear()
        cpu_kernels._library.cache_clear()
