"""The Triton fused experts (engine/kernels/fused_moe.py) against the torch experts of
engine/models/moe.py (``grouped_by_expert``), for both kinds of expert, on random inputs.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which is slow: shapes stay small. The interpreter rounds float32 to bfloat16 by truncation (a
GPU rounds to nearest even), and the kernels round at each step the torch path rounds at, so
bfloat16 drifts a few steps from torch here; float16 and float32 are held close.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import fused_moe
from engine.kernels.fused_moe import clamped_swiglu_experts, silu_experts
from engine.kernels.matmul_tiling import MatmulTiling
from engine.models.moe import ClampedSwigluExperts, RoutedExperts
from engine.moe_config import MoeConfig
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import make_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Experts = RoutedExperts | ClampedSwigluExperts
KINDS = ("silu", "clamped_swiglu")
LIMIT = 1.5  # low enough that the random pre-activations below pass it


def _make_experts(
    kind: str, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, seed: int
) -> Experts:
    """Experts whose pre-activations are O(1) (gpt-oss's often past LIMIT)."""
    torch.manual_seed(seed)
    experts: Experts
    if kind == "silu":
        experts = RoutedExperts(num_experts, hidden, intermediate)
    else:
        moe = MoeConfig(
            num_experts=num_experts,
            num_experts_per_token=1,
            expert_intermediate_size=intermediate,
            normalize_top_k=False,
            sparse_layers=(0,),
            shared_expert_intermediate_size=0,
            expert_activation="clamped_swiglu",
            swiglu_limit=LIMIT,
        )
        experts = ClampedSwigluExperts(moe, hidden, intermediate)
    with torch.no_grad():
        for name, param in experts.named_parameters():
            fan_in = intermediate if name.startswith("down_proj") else hidden
            std = 0.5 if name.endswith("bias") else 1.5 / fan_in**0.5
            param.normal_(0.0, std)
    return experts.to(device=DEVICE, dtype=dtype).requires_grad_(False)


def _routing(
    num_tokens: int, top_k: int, num_experts: int, pattern: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [n, top_k] fp32, expert ids [n, top_k]
    """Distinct experts per token: any of them ("random"), only the even ones ("idle": the odd
    experts get no token), or experts 1 .. top_k for every token ("crowded": expert 1 takes
    every token)."""
    generator = torch.Generator().manual_seed(seed)
    if pattern == "crowded":
        ids = torch.arange(1, 1 + top_k).repeat(num_tokens, 1)
    else:
        pool = torch.arange(0, num_experts, 2 if pattern == "idle" else 1)
        order = torch.rand(num_tokens, len(pool), generator=generator).argsort(dim=1)
        ids = pool[order[:, :top_k]]
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


def _fused(
    experts: Experts,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiling: MatmulTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(experts, RoutedExperts):
        return silu_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, tiling)
    return clamped_swiglu_experts(
        x,
        weights,
        ids,
        experts.gate_up_proj,
        experts.gate_up_proj_bias,
        experts.down_proj,
        experts.down_proj_bias,
        experts.alpha,
        experts.limit,
        tiling,
    )


def _torch_path(
    experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """The experts' own torch code (``grouped_by_expert``), on any device."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_moe, "usable", lambda x: False)
        return experts(x, weights, ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "pattern"),
    [(1, 1, "random"), (13, 2, "idle"), (40, 1, "crowded"), (40, 2, "random")],
)
def test_fused_experts_equal_the_torch_experts_in_float32(
    kind: str, num_tokens: int, top_k: int, pattern: str
) -> None:
    """One token; experts with no token; one expert with every token (three row tiles); a
    batch spread over all of them."""
    experts = _make_experts(kind, 8, 64, 48, torch.float32, seed=num_tokens)
    weights, ids = _routing(num_tokens, top_k, 8, pattern, seed=num_tokens)
    x = torch.randn(num_tokens, 64, device=DEVICE)
    expected, expected_counts = _torch_path(experts, x, weights, ids)
    got, counts = _fused(experts, x, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert counts.tolist() == expected_counts
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_many_column_blocks_and_input_steps(kind: str) -> None:
    """Tiles of 16 x 16 over 48 inputs and 40 columns: three K steps and three column blocks
    per projection, the last of each partial; int32 expert ids."""
    experts = _make_experts(kind, 4, 48, 40, torch.float32, seed=5)
    weights, ids = _routing(21, 2, 4, "random", seed=5)
    x = torch.randn(21, 48, device=DEVICE)
    tiling = MatmulTiling(block_m=16, block_n=16, block_k=16)
    got, _ = _fused(experts, x, weights, ids.to(torch.int32), tiling)
    torch.testing.assert_close(got, _torch_path(experts, x, weights, ids)[0], atol=1e-5, rtol=1e-5)


def test_gpt_oss_clamps_bite_and_are_applied() -> None:
    """Pre-activations well past the limit, on both sides: the fused result is the clamped one,
    far from what the experts give without the clamps."""
    experts = _make_experts("clamped_swiglu", 4, 32, 32, torch.float32, seed=6)
    assert isinstance(experts, ClampedSwigluExperts)
    weights, ids = _routing(16, 2, 4, "random", seed=6)
    x = torch.randn(16, 32, device=DEVICE) * 3
    pre_activations = torch.einsum("th,ehc->tec", x, experts.gate_up_proj)
    pre_activations += experts.gate_up_proj_bias
    assert (pre_activations > 2 * LIMIT).float().mean() > 0.1
    assert (pre_activations[..., 1::2] < -2 * LIMIT).float().mean() > 0.1  # up's lower clamp
    got, _ = _fused(experts, x, weights, ids)
    torch.testing.assert_close(got, _torch_path(experts, x, weights, ids)[0], atol=1e-5, rtol=1e-5)
    experts.limit = 1e9
    unclamped = _torch_path(experts, x, weights, ids)[0]
    assert not torch.allclose(got, unclamped, atol=0.1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_dtypes_stay_close_to_the_torch_experts(kind: str, dtype: torch.dtype) -> None:
    """float16 within two steps of torch (another summation order flips a rounding; a missed
    rounding point moves results further); bfloat16 within 3% of the output's scale, the
    interpreter truncating at each rounding (module docstring)."""
    experts = _make_experts(kind, 6, 64, 32, dtype, seed=7)
    weights, ids = _routing(17, 2, 6, "random", seed=7)
    x = torch.randn(17, 64, device=DEVICE).to(dtype)
    expected = _torch_path(experts, x, weights, ids)[0].float()
    got, _ = _fused(experts, x, weights, ids)
    assert got.dtype == dtype
    if dtype == torch.float16:
        torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2**-9)
    else:
        atol = 3e-2 * expected.abs().max().item()
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


def test_an_empty_batch_gives_no_rows_and_no_tokens_per_expert() -> None:
    experts = _make_experts("silu", 4, 32, 32, torch.float32, seed=9)
    x = torch.empty(0, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    got, counts = _fused(experts, x, torch.empty(0, 2, device=DEVICE), ids)
    assert got.shape == (0, 32) and counts.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_experts_take_the_fused_path_on_a_gpu(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``usable`` says a GPU tensor, the experts' forward runs the kernels and returns
    the counts as a list; on CPU it keeps the torch path."""
    experts = _make_experts(kind, 4, 32, 32, torch.float32, seed=10)
    weights, ids = _routing(11, 2, 4, "idle", seed=10)
    x = torch.randn(11, 32, device=DEVICE)
    expected, expected_counts = _torch_path(experts, x, weights, ids)
    calls: list[str] = []
    name = "silu_experts" if kind == "silu" else "clamped_swiglu_experts"
    kernel = getattr(fused_moe, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused_moe, name, counted)
    if DEVICE == "cpu":
        experts(x, weights, ids)
        assert calls == []  # a CPU tensor: the torch path
        monkeypatch.setattr(fused_moe, "usable", lambda x: True)
    got, counts = experts(x, weights, ids)
    assert calls == [name]
    assert counts == expected_counts == [11, 0, 11, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused_naming_them() -> None:
    experts = _make_experts("silu", 4, 32, 16, torch.float32, seed=11)
    assert isinstance(experts, RoutedExperts)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    x = torch.randn(3, 32, device=DEVICE)
    weights, ids = _routing(3, 2, 4, "random", seed=11)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, hidden\]"):
        silu_experts(x[None], weights, ids, gate_up, down)
    with pytest.raises(ValueError, match="expert_ids must be int32 or int64"):
        silu_experts(x, weights, ids.float(), gate_up, down)
    with pytest.raises(ValueError, match=r"weights must be \[num_tokens, top_k\]"):
        silu_experts(x, weights[:, :1], ids, gate_up, down)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \[num_experts, 2 \* interm"):
        silu_experts(x, weights, ids, gate_up[:, :31], down)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \[4, 32, 32\]"):
        silu_experts(x, weights, ids, gate_up[..., :16], down)
    with pytest.raises(ValueError, match=r"down_proj must be \[4, 32, 16\]"):
        silu_experts(x, weights, ids, gate_up, down.transpose(1, 2))
    with pytest.raises(ValueError, match="down_proj dtype torch.float64 != x's torch.float32"):
        silu_experts(x, weights, ids, gate_up, down.double())
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 4\), got 0 .. 4"):
        silu_experts(x, weights, torch.tensor([[0, 4]] * 3, device=DEVICE), gate_up, down)
    with pytest.raises(ValueError, match="tiling.block_m must be a power of two >= 16"):
        silu_experts(x, weights, ids, gate_up, down, MatmulTiling(block_m=8))
    gpt_oss = _make_experts("clamped_swiglu", 4, 32, 16, torch.float32, seed=11)
    assert isinstance(gpt_oss, ClampedSwigluExperts)
    arguments = {
        "gate_up_proj": gpt_oss.gate_up_proj,
        "gate_up_bias": gpt_oss.gate_up_proj_bias,
        "down_proj": gpt_oss.down_proj,
        "down_bias": gpt_oss.down_proj_bias,
    }
    for name, bad in (
        ("gate_up_bias", gpt_oss.gate_up_proj_bias[:, :8]),
        ("down_bias", gpt_oss.down_proj_bias.half()),
    ):
        with pytest.raises(ValueError, match=name):
            clamped_swiglu_experts(
                x, weights, ids, **{**arguments, name: bad}, alpha=1.7, limit=7.0
            )
    with pytest.raises(ValueError, match="limit must be > 0"):
        clamped_swiglu_experts(x, weights, ids, **arguments, alpha=1.7, limit=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_at_real_sizes_on_gpu_repeats_bit_for_bit(kind: str) -> None:
    """Mixtral-like widths, a prefill's 300 tokens top-2 of 8 (64-row tiles) and a decode
    batch's 4 (16-row tiles): close to torch's experts, and the same bits on a second run."""
    experts = _make_experts(kind, 8, 1024, 512, torch.bfloat16, seed=12)
    for num_tokens in (300, 4):
        weights, ids = _routing(num_tokens, 2, 8, "random", seed=num_tokens)
        x = torch.randn(num_tokens, 1024, device=DEVICE).to(torch.bfloat16)
        expected = _torch_path(experts, x, weights, ids)[0].float()
        got, counts = _fused(experts, x, weights, ids)
        atol = 1e-2 * expected.abs().max().item()
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=2e-2)
        assert torch.equal(got, _fused(experts, x, weights, ids)[0])
        assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "GptOssForCausalLM"])
def test_greedy_matches_transformers_through_the_fused_experts(
    model_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny MoE models with their experts in the Triton kernels (the interpreter on CPU),
    as on a GPU: Mixtral's SiLU experts, gpt-oss's clamped ones; a prefill of three prompts,
    then decode steps of the three."""
    monkeypatch.setattr(fused_moe, "usable", lambda x: True)
    model_dir = model_dirs[arch]
    prompts = [prompt for prompt in make_prompts(seed=2) if 1 < len(prompt) <= 40]
    # the experts' weights stay stacked, as on a GPU (oneDNN packs them on a CPU)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        enable_prefix_caching=False,
        linear_backend="torch",
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    expected = [hf_greedy(model_dir, prompt, 6) for prompt in prompts]
    assert [output.outputs[0].token_ids for output in outputs] == expected


def _held_part(whole: Experts, held: range) -> Experts:
    """The experts ``held`` of ``whole``, as a rank of expert parallelism holds them."""
    first, last = held.start, held.stop
    part: Experts
    if isinstance(whole, RoutedExperts):
        part = RoutedExperts(whole.num_experts, 1, 1, held)
    else:
        moe = MoeConfig(
            num_experts=whole.num_experts,
            num_experts_per_token=1,
            expert_intermediate_size=1,
            normalize_top_k=False,
            sparse_layers=(0,),
            shared_expert_intermediate_size=0,
            expert_activation="clamped_swiglu",
            swiglu_limit=LIMIT,
        )
        part = ClampedSwigluExperts(moe, 1, 1, held)
    for name, param in whole.named_parameters():
        setattr(part, name, torch.nn.Parameter(param[first:last].clone(), requires_grad=False))
    return part


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_of_held_experts_add_up_to_all_of_them(kind: str) -> None:
    """Expert parallelism: three ranks holding experts 0-2, 3-5 and 6-7 each run only their
    pairs, fused as in torch; their outputs add up to the whole layer's, and each counts
    every expert's tokens."""
    experts = _make_experts(kind, 8, 64, 48, torch.float32, seed=9)
    weights, ids = _routing(30, 2, 8, "random", seed=9)
    x = torch.randn(30, 64, device=DEVICE)
    whole, whole_counts = _torch_path(experts, x, weights, ids)
    total = torch.zeros_like(x)
    for held in (range(0, 3), range(3, 6), range(6, 8)):
        part = _held_part(experts, held)
        mine = ((ids >= held.start) & (ids < held.stop)).to(weights.dtype)
        alone, _ = _torch_path(experts, x, weights * mine, ids)  # the others' pairs weigh 0
        expected, counts = _torch_path(part, x, weights, ids)
        torch.testing.assert_close(expected, alone, atol=1e-5, rtol=1e-5)
        assert counts == whole_counts
        got, fused_counts = _fused_held(part, x, weights, ids)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert fused_counts == whole_counts
        total += got
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)


def _fused_held(
    part: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """The layer's forward through the fused kernels (in Triton's interpreter on a CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_moe, "usable", lambda x: True)
        return part(x, weights, ids)
