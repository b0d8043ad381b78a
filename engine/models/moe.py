"""The sparse MLP of mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3,
gpt-oss).

A router (``gate``: one logit per expert) scores the experts and keeps the top k per token
(``route``): Mixtral and Qwen take a softmax, renormalise the top k to sum to 1 where the
model says so; DeepSeek-V2 takes a softmax too, DeepSeek-V3 a sigmoid with a learned
correction bias for choosing, and both may first narrow each token to its best groups of
experts and scale the weights last; gpt-oss's router has a bias and softmaxes only the top k
logits it chose. An expert is a gated MLP: SiLU(gate) * up, or gpt-oss's clamped SwiGLU with
biases, whose weights stay in the checkpoint's layout (``ClampedSwigluExperts``). Tokens are
then grouped by expert (``grouped_by_expert``): the (token, expert) pairs are sorted by
expert, each expert runs its MLP once over the contiguous rows of its tokens, and the weighted
outputs are added back per token in expert order (the order transformers adds them in). There
is no loop over tokens; the loop over experts skips the ones no token picked. On a GPU (a CUDA
float ``x``) the experts run instead as two Triton grouped matmuls over the same sorted rows,
the activation and the routing weight fused into them (``engine/kernels/fused_moe.py``); the
tokens per expert are then read from the device once per layer.

A shared expert, when the model has one, runs on every token and joins the routed sum: scaled
by sigmoid(shared_expert_gate(x)) (Qwen2-MoE) or as it is (DeepSeek's shared experts, one MLP
as wide as all of them).

Tensor parallelism: every rank holds every expert's slice of intermediate columns (and the
shared expert's), so a rank's routed and shared outputs are partial sums and the block ends
in one all-reduce, as a dense MLP does (a bias of the experts' down projection is held by
rank 0 alone, so the sum adds it once). The router is replicated. With expert parallelism a
rank holds a run of whole experts instead (``held``: engine/parallel/shard.py): every rank
routes every token alike, runs only the pairs of the experts it holds, and the same one
all-reduce adds the ranks' shares (an expert's bias by the one rank that holds it). The
step's tokens per expert are counted over all experts on every rank.

Quantized checkpoints (FP8 blocks, packed integers): the routed experts keep their quantized
weights stacked (``QuantizedRoutedExperts``) and run grouped by expert as above, each expert's
weights dequantized for the step it has tokens in (on a GPU the dense layers' quantized kernels
run per expert instead); the shared expert's projections are the dense layers' quantized ones;
the router stays float. gpt-oss's MXFP4 experts (``Mxfp4ClampedSwigluExperts``) run the same
way on every device: each expert with tokens dequantized for the step.

The step's tokens per expert are added to the forward context's ``ExpertTokenCounts`` when it
has one (rows past the batch, the runner's padding, are neither routed nor counted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context
from engine.kernels import fused_moe
from engine.kernels.linear import PackedLinear, padded_rows
from engine.models.fused_ops import silu_and_mul
from engine.moe_config import MoeConfig
from engine.parallel.group import TensorParallelGroup
from engine.quantization.config import Mxfp4ExpertWeights, WeightQuantization
from engine.quantization.linear import make_linear
from engine.quantization.mxfp4_experts import (
    BYTES_PER_GROUP,
    GROUP,
    check_mxfp4_width,
    dequantize_mxfp4,
)
from engine.quantization.quantized_experts import ExpertWeights, make_expert_weights


def route(
    router_logits: torch.Tensor,  # [n, num_experts]
    moe: MoeConfig,
    correction_bias: torch.Tensor | None = None,  # [num_experts] fp32 (score_correction_bias)
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [n, top_k] fp32, expert ids [n, top_k]
    """Each token's top k experts and their weights, as ``moe``'s router picks them (see the
    module docstring); scores in float32, but for gpt-oss's (the logits' dtype)."""
    if moe.softmax_after_top_k:
        top_logits, expert_ids = torch.topk(router_logits, moe.num_experts_per_token, dim=-1)
        return torch.softmax(top_logits, dim=-1), expert_ids
    if moe.scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.num_groups > 1:
        choice = _best_groups_only(choice, moe, fill=0.0 if correction_bias is None else None)
    if correction_bias is None:
        weights, expert_ids = torch.topk(choice, moe.num_experts_per_token, dim=-1)
    else:  # chosen by the corrected scores, weighted by the scores themselves
        expert_ids = torch.topk(choice, moe.num_experts_per_token, dim=-1)[1]
        weights = scores.gather(1, expert_ids)
    if moe.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, expert_ids


def _best_groups_only(
    scores: torch.Tensor,  # [n, num_experts] fp32
    moe: MoeConfig,
    fill: float | None,  # what the other groups' experts score; None: -inf
) -> torch.Tensor:  # [n, num_experts] fp32
    """The scores of each token's ``top_groups`` best groups, the others' replaced by ``fill``.
    A group scores its best expert's score, or its best two's sum (``group_score``)."""
    grouped = scores.view(scores.shape[0], moe.num_groups, -1)  # [n, groups, experts per group]
    if moe.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = torch.topk(group_scores, moe.top_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    kept = kept.unsqueeze(-1).expand_as(grouped).reshape(scores.shape)
    return scores.masked_fill(~kept, float("-inf") if fill is None else fill)


class Router(nn.Module):
    """One logit per expert (``weight``, and gpt-oss's ``bias``), and DeepSeek-V3's per-expert
    correction bias."""

    def __init__(self, moe: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias: nn.Parameter | None = None
        if moe.router_bias:
            self.bias = nn.Parameter(torch.empty(moe.num_experts))
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, hidden]
        """Weights [n, top_k] and expert ids [n, top_k] of each token."""
        if self.moe.router_in_float32:
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        bias = self.e_score_correction_bias
        return route(logits, self.moe, None if bias is None else bias.float())


def grouped_by_expert(
    x: torch.Tensor,  # [n, hidden]
    weights: torch.Tensor,  # [n, top_k]
    expert_ids: torch.Tensor,  # [n, top_k] int64
    num_experts: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (held expert, its rows) -> out
    held: range | None = None,  # the experts this rank holds (expert parallelism); None: all
) -> tuple[torch.Tensor, list[int]]:  # [n, hidden], tokens per expert (every expert's)
    """Each held expert's MLP once over the contiguous rows of its tokens (``expert_mlp`` takes
    the expert's index among the held ones), the outputs weighted and added back per token in
    expert order (as transformers adds each expert's share in turn); the pairs of experts held
    elsewhere add nothing here."""
    held = range(num_experts) if held is None else held
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)  # [n * top_k]
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens in order
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    if len(held) < num_experts:  # the held experts' pairs, contiguous in that order
        first = sum(counts[: held.start])
        order = order[first : first + sum(counts[held.start : held.stop])]
    tokens = order // top_k  # the token of each sorted pair
    grouped = x.index_select(0, tokens)  # [pairs, hidden] each expert's rows together
    outputs = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts[held.start : held.stop]):
        if count == 0:
            continue
        outputs[start : start + count] = expert_mlp(expert, grouped[start : start + count])
        start += count
    scaled = (outputs * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled), counts


def _part_held(held: range, num_experts: int) -> range | None:
    """``held`` where it is a part of the experts (expert parallelism), else None."""
    return held if len(held) < num_experts else None


def _every_experts_counts(
    fused_counts: torch.Tensor,  # [held experts] the fused kernels' tokens per held expert
    expert_ids: torch.Tensor,  # [n, top_k]
    held: range,
    num_experts: int,
) -> list[int]:
    """Tokens per expert, every expert's (the fused kernels count the held ones alone)."""
    if len(held) < num_experts:
        return torch.bincount(expert_ids.reshape(-1), minlength=num_experts).tolist()
    return fused_counts.tolist()


def _packed(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> nn.ModuleList:
    """Each expert's projection (its weight as ``x @ W.T`` takes it, its bias or None) packed
    for oneDNN."""
    return nn.ModuleList(PackedLinear(weight, bias) for weight, bias in projections)


def _give_up(module: nn.Module, *names: str) -> None:
    """Empty ``module``'s stacked parameters ``names`` (their packed copies are the weights
    from then on)."""
    for name in names:
        stacked = getattr(module, name)
        empty = torch.empty(0, dtype=stacked.dtype, device=stacked.device)
        setattr(module, name, nn.Parameter(empty, requires_grad=False))


def _packed_mlp(
    gate_up: nn.Module,  # an expert's PackedLinear
    down: nn.Module,  # ... and its other
    rows: torch.Tensor,  # [m, hidden]
    activation: Callable[[torch.Tensor], torch.Tensor],  # gate_up's output -> down's input
) -> torch.Tensor:  # [m, hidden]
    """One expert's MLP through its oneDNN-packed projections, its rows padded to
    ``padded_rows`` (so that the kernels oneDNN builds per row count stay few)."""
    count = rows.shape[0]
    padding = padded_rows(count) - count
    if padding:
        rows = F.pad(rows, (0, 0, 0, padding))
    out: torch.Tensor = down(activation(gate_up(rows)))
    return out[:count] if padding else out


class RoutedExperts(nn.Module):
    """Every expert's gated MLP, stacked: ``gate_up_proj[e]`` holds expert e's gate rows then its
    up rows (this rank's columns of each), ``down_proj[e]`` its input columns.

    On a CPU whose projections run through oneDNN (``linear_backend`` onednn, as the dense
    layers': engine/kernels/linear.py) the loader packs each expert's two projections once
    (``pack_for_onednn``), and an expert's rows then run through them, padded to
    ``padded_rows`` so that the kernels oneDNN builds per row count stay few; the stacked
    weights are given up (the packed copies are the weights from then on). oneDNN took an
    expert's projection at 1.7-2.7x torch's speed on the 2-core machine (1 to 256 rows)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate: int,
        held: range | None = None,  # the experts this rank holds (expert parallelism); None: all
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.held = range(num_experts) if held is None else held
        count = len(self.held)
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, intermediate))
        # each expert's projections packed for oneDNN (empty: the stacked weights run)
        self.packed_gate_up = nn.ModuleList()
        self.packed_down = nn.ModuleList()

    def pack_for_onednn(self) -> None:
        """Each expert's projections reordered into oneDNN's layout; the stacked weights go
        (once: packed experts stay so)."""
        if self.packed_gate_up:
            return
        experts = range(len(self.held))
        self.packed_gate_up = _packed((self.gate_up_proj[e], None) for e in experts)
        self.packed_down = _packed((self.down_proj[e], None) for e in experts)
        _give_up(self, "gate_up_proj", "down_proj")

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        expert_ids: torch.Tensor,  # [n, top_k] int64
    ) -> tuple[torch.Tensor, list[int]]:  # [n, hidden], tokens per expert
        if not self.packed_gate_up and fused_moe.usable(x):
            out, counts = fused_moe.silu_experts(
                x,
                weights,
                expert_ids,
                self.gate_up_proj,
                self.down_proj,
                held=_part_held(self.held, self.num_experts),
            )
            return out, _every_experts_counts(counts, expert_ids, self.held, self.num_experts)
        return grouped_by_expert(x, weights, expert_ids, self.num_experts, self._mlp, self.held)

    def _mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [m, hidden]
        if self.packed_gate_up:
            gate_up, down = self.packed_gate_up[expert], self.packed_down[expert]
            return _packed_mlp(gate_up, down, rows, silu_and_mul)
        hidden = silu_and_mul(F.linear(rows, self.gate_up_proj[expert]))
        return F.linear(hidden, self.down_proj[expert])


class QuantizedRoutedExperts(nn.Module):
    """``RoutedExperts`` whose stacked weights stay as the checkpoint quantized them (FP8
    blocks or packed integers: engine/quantization/quantized_experts.py). Each expert with
    tokens runs its MLP on its rows, its weights dequantized for that step alone (on a GPU,
    read tile by tile by the dense layers' kernels), so no more than one expert's float weight
    exists at a time; experts without tokens are not touched."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate: int,
        quantization: WeightQuantization,
        held: range | None = None,  # the experts this rank holds (expert parallelism); None: all
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.held = range(num_experts) if held is None else held
        self.gate_up_proj: ExpertWeights = make_expert_weights(
            len(self.held), hidden_size, 2 * intermediate, quantization
        )
        self.down_proj: ExpertWeights = make_expert_weights(
            len(self.held), intermediate, hidden_size, quantization
        )

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        expert_ids: torch.Tensor,  # [n, top_k] int64
    ) -> tuple[torch.Tensor, list[int]]:  # [n, hidden], tokens per expert
        return grouped_by_expert(x, weights, expert_ids, self.num_experts, self._mlp, self.held)

    def _mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [m, hidden]
        hidden = silu_and_mul(self.gate_up_proj.matmul(expert, rows))
        return self.down_proj.matmul(expert, hidden)


class ClampedSwigluExperts(nn.Module):
    """gpt-oss's experts, in its checkpoint's layout: ``gate_up_proj[e]`` is [hidden, 2 x this
    rank's columns] (x @ W), gate and up columns interleaved; ``down_proj[e]`` [columns,
    hidden]; each with a bias (the down projection's held by rank 0 only, zeros elsewhere, so
    the all-reduce adds it once). Its MLP is (up + 1) * gate * sigmoid(alpha * gate), gate
    clamped from above and up both ways at the limit.

    Packed for oneDNN on a CPU as ``RoutedExperts`` are (``pack_for_onednn``): each expert's
    projections transposed once into ``x @ W.T`` form with their biases, the stacked weights
    given up."""

    def __init__(
        self,
        moe: MoeConfig,
        hidden_size: int,
        intermediate: int,
        held: range | None = None,  # the experts this rank holds (expert parallelism); None: all
    ) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.held = range(moe.num_experts) if held is None else held
        experts = len(self.held)
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden_size, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(experts, intermediate, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden_size))
        # each expert's projections packed for oneDNN, biases in (empty: the stacked ones run)
        self.packed_gate_up = nn.ModuleList()
        self.packed_down = nn.ModuleList()

    def pack_for_onednn(self) -> None:
        """Each expert's projections, with their biases, reordered into oneDNN's layout; the
        stacked weights go (once: packed experts stay so)."""
        if self.packed_gate_up:
            return
        experts = range(len(self.held))
        self.packed_gate_up = _packed(
            (self.gate_up_proj[e].t().contiguous(), self.gate_up_proj_bias[e].clone())
            for e in experts
        )
        self.packed_down = _packed(
            (self.down_proj[e].t().contiguous(), self.down_proj_bias[e].clone()) for e in experts
        )
        _give_up(self, "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k]
        expert_ids: torch.Tensor,  # [n, top_k] int64
    ) -> tuple[torch.Tensor, list[int]]:  # [n, hidden], tokens per expert
        if not self.packed_gate_up and fused_moe.usable(x):
            out, counts = fused_moe.clamped_swiglu_experts(
                x,
                weights,
                expert_ids,
                self.gate_up_proj,
                self.gate_up_proj_bias,
                self.down_proj,
                self.down_proj_bias,
                self.alpha,
                self.limit,
                held=_part_held(self.held, self.num_experts),
            )
            return out, _every_experts_counts(counts, expert_ids, self.held, self.num_experts)
        return grouped_by_expert(x, weights, expert_ids, self.num_experts, self._mlp, self.held)

    def _mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [m, hidden]
        if self.packed_gate_up:
            gate_up, down = self.packed_gate_up[expert], self.packed_down[expert]
            return _packed_mlp(gate_up, down, rows, self._activation)
        pre_activation = rows @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        hidden = self._activation(pre_activation)
        return hidden @ self.down_proj[expert] + self.down_proj_bias[expert]

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # [m, 2 x cols] -> [m, cols]
        return clamped_swiglu(gate_up, self.alpha, self.limit)


def clamped_swiglu(
    gate_up: torch.Tensor,  # [m, 2 x cols]: gate and up interleaved
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [m, cols]
    """gpt-oss's activation: (up + 1) * gate * sigmoid(alpha * gate), gate clamped from above
    and up both ways at ``limit``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Mxfp4ClampedSwigluExperts(nn.Module):
    """gpt-oss's experts as OpenAI publishes them: gate_up and down in MXFP4
    (engine/quantization/mxfp4_experts.py: ``*_blocks`` [E, out, in / 32, 16] and ``*_scales``
    [E, out, in / 32] uint8, output rows first), their biases float (the down projection's
    added once, as ``ClampedSwigluExperts``'). Each expert with tokens in a step has its two
    weights dequantized into the activations' dtype for that step alone, then runs as the
    float experts' unpacked path does; the layer stays 4.25 bits a weight."""

    def __init__(
        self,
        moe: MoeConfig,
        hidden_size: int,
        intermediate: int,  # this rank's columns of each expert
        held: range | None = None,  # the experts this rank holds (expert parallelism); None: all
    ) -> None:
        super().__init__()
        check_mxfp4_width("hidden_size", hidden_size)
        check_mxfp4_width("a rank's columns of each expert (intermediate_size / tp)", intermediate)
        self.num_experts = moe.num_experts
        self.held = range(moe.num_experts) if held is None else held
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        experts, groups = len(self.held), hidden_size // GROUP
        self.gate_up_proj_blocks = _bytes(experts, 2 * intermediate, groups, BYTES_PER_GROUP)
        self.gate_up_proj_scales = _bytes(experts, 2 * intermediate, groups)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * intermediate))
        self.down_proj_blocks = _bytes(experts, hidden_size, intermediate // GROUP, BYTES_PER_GROUP)
        self.down_proj_scales = _bytes(experts, hidden_size, intermediate // GROUP)
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden_size))

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k]
        expert_ids: torch.Tensor,  # [n, top_k] int64
    ) -> tuple[torch.Tensor, list[int]]:  # [n, hidden], tokens per expert
        return grouped_by_expert(x, weights, expert_ids, self.num_experts, self._mlp, self.held)

    def dequantized(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Held expert ``expert``'s gate_up [hidden, 2 x cols] and down [cols, hidden] weights
        in ``dtype``, in the float experts' ``x @ W`` layout."""
        gate_up = dequantize_mxfp4(
            self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype
        )
        down = dequantize_mxfp4(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype)
        return gate_up.t(), down.t()

    def _mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [m, hidden]
        gate_up, down = self.dequantized(expert, rows.dtype)
        hidden = clamped_swiglu(
            rows @ gate_up + self.gate_up_proj_bias[expert], self.alpha, self.limit
        )
        return hidden @ down + self.down_proj_bias[expert]


def _bytes(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class SharedExpert(nn.Module):
    """A gated MLP every token runs (this rank's columns); no all-reduce of its own. Its
    projections are the dense layers' (``make_linear``: float or quantized alike)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate: int,
        quantization: WeightQuantization | None,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate, False, quantization)
        self.down_proj = make_linear(
            intermediate, hidden_size, False, quantization, row_group=group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden] partial
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and the optional shared expert of one layer. With a quantized
    checkpoint (``quantization``) the experts' projections hold its quantized weights; the
    router and the shared expert's gate stay float."""

    def __init__(
        self,
        moe: MoeConfig,
        hidden_size: int,
        layer_idx: int,
        expert_intermediate: int,  # this rank's columns of each expert
        shared_intermediate: int,  # this rank's columns of the shared expert
        group: TensorParallelGroup,
        quantization: WeightQuantization | None = None,
        held_experts: range | None = None,  # the experts this rank holds; None: all
    ) -> None:
        super().__init__()
        self.moe = moe
        self.layer_idx = layer_idx
        self.gate = Router(moe, hidden_size)
        self.experts: (
            RoutedExperts
            | QuantizedRoutedExperts
            | ClampedSwigluExperts
            | Mxfp4ClampedSwigluExperts
        )
        if moe.expert_activation == "clamped_swiglu" and isinstance(
            quantization, Mxfp4ExpertWeights
        ):
            self.experts = Mxfp4ClampedSwigluExperts(
                moe, hidden_size, expert_intermediate, held_experts
            )
        elif moe.expert_activation == "clamped_swiglu":
            if quantization is not None:
                raise ValueError(
                    f"quantization_config ({quantization.describe()}) is not supported for "
                    "clamped-SwiGLU experts (gpt-oss)"
                )
            self.experts = ClampedSwigluExperts(moe, hidden_size, expert_intermediate, held_experts)
        elif quantization is not None:
            assert not isinstance(quantization, Mxfp4ExpertWeights)  # (gpt-oss's alone)
            self.experts = QuantizedRoutedExperts(
                moe.num_experts, hidden_size, expert_intermediate, quantization, held_experts
            )
        else:
            self.experts = RoutedExperts(
                moe.num_experts, hidden_size, expert_intermediate, held_experts
            )
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size > 0:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate, quantization, group)
        if moe.shared_expert_intermediate_size > 0 and moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, hidden]
        context = get_forward_context()
        num_tokens = context.attn_metadata.num_tokens
        num_padding = hidden.shape[0] - num_tokens  # the runner's padding rows: not routed
        x = hidden[:num_tokens] if num_padding > 0 else hidden
        weights, expert_ids = self.gate(x)
        out, counts = self.experts(x, weights, expert_ids)
        if context.expert_tokens is not None:
            context.expert_tokens.add(self.layer_idx, counts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        out = self.group.all_reduce(out)
        return F.pad(out, (0, 0, 0, num_padding)) if num_padding > 0 else out
