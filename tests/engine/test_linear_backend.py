"""The projections' matmul backends: oneDNN-packed linears match F.linear, and both backends
decode exactly what transformers decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM
from engine.engine_config import LoadConfig
from engine.kernels.linear import (
    EXACT_ROWS,
    PackedLinear,
    onednn_supports,
    pack_linears,
    padded_rows,
    resolve_linear_backend,
)
from tests.engine.test_parity import engine_tokens, greedy_params, make_prompts, reference

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_supports(CPU, torch.float32), reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(num_tokens: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(num_tokens, 40, generator=generator)
    packed = PackedLinear(weight, bias)
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice of a wider activation) gives the same result
    wide = torch.randn(num_tokens, 80, generator=generator)
    torch.testing.assert_close(
        packed(wide[:, ::2]), F.linear(wide[:, ::2], weight, bias), rtol=1e-5, atol=1e-5
    )


@needs_onednn
def test_packed_linear_bfloat16_where_the_cpu_has_it() -> None:
    if not onednn_supports(CPU, torch.bfloat16):
        pytest.skip("this CPU has no bf16 instructions for oneDNN")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator).bfloat16()
    x = torch.randn(5, 32, generator=generator).bfloat16()
    out = PackedLinear(weight, None)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=2e-2
    )


@needs_onednn
def test_packed_linear_rejects_a_wrong_shape() -> None:
    packed = PackedLinear(torch.randn(8, 4), None)
    with pytest.raises(AssertionError, match=r"expects \[num_tokens, 4\]"):
        packed(torch.randn(2, 5))


@needs_onednn
def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_backend_resolution() -> None:
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "torch"
    assert resolve_linear_backend("auto", torch.device("meta"), torch.float32) == "torch"
    with pytest.raises(ValueError, match="linear_backend 'onednn' needs a CPU"):
        resolve_linear_backend("onednn", torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, torch, onednn"):
        LoadConfig("some/dir", linear_backend="mkl")


@needs_onednn
def test_auto_picks_onednn_on_cpu_float32() -> None:
    assert resolve_linear_backend("auto", CPU, torch.float32) == "onednn"


@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_greedy_matches_transformers_with_each_backend(llama_dir: Path, backend: str) -> None:
    if backend == "onednn" and not onednn_supports(CPU, torch.float32):
        pytest.skip("this torch build has no oneDNN")
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", linear_backend=backend)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    expected_type = PackedLinear if backend == "onednn" else nn.Linear
    assert linears and all(isinstance(m, expected_type) for m in linears)
    prompts = make_prompts(seed=1)
    assert engine_tokens(llm, prompts) == reference(llama_dir, prompts, "plain")


def test_padded_rows_are_exact_for_decode_batches_and_few_above() -> None:
    assert [padded_rows(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    for n in range(EXACT_ROWS + 1, 8193):
        assert n <= padded_rows(n) <= n * 17 / 16, n  # at most 1/16 more rows
        assert padded_rows(padded_rows(n)) == padded_rows(n)  # a bucket is its own bucket
    # 64 exact counts, then 16 buckets in each of the 7 octaves from 65 to 8192
    assert len({padded_rows(n) for n in range(1, 8193)}) == EXACT_ROWS + 16 * 7
    assert [padded_rows(n) for n in (65, 127, 129, 255, 257, 300, 511, 513)] == [
        68, 128, 136, 256, 272, 304, 512, 544,
    ]  # fmt: skip


@needs_onednn
def test_steps_give_onednn_bucketed_row_counts_and_decode_as_transformers(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN builds a kernel per row count: a step of a fresh token count runs padded to its
    bucket (attention skips the padding rows), and greedy tokens stay transformers' own."""
    rows_seen: list[int] = []
    packed_forward = PackedLinear.forward

    def recording(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return packed_forward(self, x)

    monkeypatch.setattr(PackedLinear, "forward", recording)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", linear_backend="onednn")
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    for prompt, params, tokens in zip(prompts, greedy_params(), expected, strict=True):
        rows_seen.clear()
        (out,) = llm.generate([prompt], params)
        assert out.outputs[0].token_ids == tokens
        # the prefill's projections ran on its bucket's rows; each decode step on one row
        assert padded_rows(len(prompt)) in rows_seen
        assert set(rows_seen) <= {padded_rows(len(prompt)), 1}, (len(prompt), set(rows_seen))
