"""A mixture-of-experts model's sparse MLP as its config.json describes it (``MoeConfig``),
parsed with transformers' defaults per architecture: Mixtral, Qwen2-MoE and Qwen3-MoE, gpt-oss,
DeepSeek-V2/V3 and GLM-4.5 (DeepSeek's routers), MiniMax-M2. engine/models/moe.py runs it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

_DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
_GLM4_MOE = "Glm4MoeForCausalLM"
_MINIMAX_M2 = "MiniMaxM2ForCausalLM"
# architectures whose sparse MLP is DeepSeek's (shared experts, group-limited routers)
_DEEPSEEK_MOE = ("DeepseekV2ForCausalLM", _DEEPSEEK_V3, _GLM4_MOE)

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
# transformers' defaults for the sparse MLP's keys, per architecture
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    "Qwen3MoeForCausalLM": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    "GptOssForCausalLM": {
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    },
    "DeepseekV2ForCausalLM": {
        "n_routed_experts": 64,
        "num_experts_per_tok": None,
        "moe_intermediate_size": 1407,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
    },
    "DeepseekV3ForCausalLM": {
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
    },
    # GLM-4.5 routes as DeepSeek-V3 does ("noaux_tc"), whatever topk_method says
    "Glm4MoeForCausalLM": {
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
    },
    "MiniMaxM2ForCausalLM": {"num_local_experts": 256, "num_experts_per_tok": 8},
}
# DeepSeek's top-k methods: how a router limits each token to its best groups of experts
_DEEPSEEK_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model: a router picks ``num_experts_per_token``
    of ``num_experts`` gated MLPs per token (softmax over the router's logits, then top-k)."""

    num_experts: int  # routed experts per sparse layer
    num_experts_per_token: int  # top-k
    expert_intermediate_size: int  # width of each routed expert's gated MLP
    normalize_top_k: bool  # the top-k probabilities are rescaled to sum to 1 (norm_topk_prob)
    sparse_layers: tuple[int, ...]  # layers whose MLP is sparse; the others keep the dense MLP
    # a gated MLP every token also runs; 0: none
    shared_expert_intermediate_size: int
    # the shared expert's output is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE), or
    # added as it is (DeepSeek)
    shared_expert_gated: bool = True
    # DeepSeek's routers. ``scoring``: softmax or sigmoid of the router's logits, computed in
    # float32 (``router_in_float32``) or the model's dtype. Group-limited top-k: the experts
    # form ``num_groups`` equal groups, each token picks its ``top_groups`` best groups
    # (``group_score``: a group's best score, or the sum of its best two) and its top k
    # experts among them. ``score_correction_bias``: a learned per-expert bias added to the
    # scores for choosing, not for weighting (DeepSeek-V3). The chosen weights are scaled by
    # ``routed_scaling_factor`` last.
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    router_in_float32: bool = False
    num_groups: int = 1
    top_groups: int = 1
    group_score: str = "max"  # "max" | "top2_sum"
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    # gpt-oss: the router's logits have a bias, and the softmax runs over each token's top k
    # logits (after choosing) rather than over all experts
    router_bias: bool = False
    softmax_after_top_k: bool = False
    # the experts' MLP: SiLU(gate) * up, or gpt-oss's clamped SwiGLU, (up + 1) * gate *
    # sigmoid(alpha * gate) with gate <= limit and -limit <= up <= limit, whose experts have
    # biases and are stored as the checkpoint has them ([hidden, 2 x width], gate and up
    # columns interleaved)
    expert_activation: str = "silu"  # "silu" | "clamped_swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _field(raw: dict[str, Any], defaults: dict[str, Any], key: str) -> Any:
    """config.json's ``key``, else transformers' default for it."""
    value = raw.get(key)
    return defaults[key] if value is None else value


def parse_moe(raw: dict[str, Any], architecture: str, num_layers: int) -> MoeConfig | None:
    """The sparse MLP as transformers builds it for ``architecture`` (None for dense models)."""
    defaults = _MOE_DEFAULTS.get(architecture)
    if defaults is None:
        return None
    if architecture in _DEEPSEEK_MOE:
        return _parse_deepseek_moe(raw, defaults, architecture, num_layers)
    if architecture == "GptOssForCausalLM":
        return _parse_gpt_oss_moe(raw, defaults, num_layers)
    if architecture == _MINIMAX_M2:
        return _parse_minimax_m2_moe(raw, defaults, num_layers)

    field = partial(_field, raw, defaults)

    # the expert count goes by either name (transformers maps one onto the other, and saves
    # whichever its config class holds)
    experts_key = next((k for k in _EXPERT_COUNT_KEYS if raw.get(k) is not None), None)
    num_experts = int(raw[experts_key] if experts_key else defaults["num_experts"])
    if architecture == "MixtralForCausalLM":  # every layer sparse, always renormalised
        expert_intermediate = int(raw["intermediate_size"])
        normalize, sparse_layers, shared = True, tuple(range(num_layers)), 0
    else:  # Qwen2-MoE, Qwen3-MoE: every decoder_sparse_step-th layer, less mlp_only_layers
        expert_intermediate = int(field("moe_intermediate_size"))
        normalize = bool(field("norm_topk_prob"))
        step = int(field("decoder_sparse_step"))
        if step < 1:
            raise ValueError(f"decoder_sparse_step {step} must be at least 1")
        dense = {int(layer) for layer in raw.get("mlp_only_layers") or ()}
        sparse_layers = tuple(
            i
            for i in range(num_layers)
            if i not in dense and num_experts > 0 and (i + 1) % step == 0
        )
        shared = (
            int(field("shared_expert_intermediate_size"))
            if "shared_expert_intermediate_size" in defaults
            else 0
        )
    top_k = int(field("num_experts_per_tok"))
    if sparse_layers and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1 .. {num_experts} (the experts)")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=expert_intermediate,
        normalize_top_k=normalize,
        sparse_layers=sparse_layers,
        shared_expert_intermediate_size=shared,
    )


def _parse_deepseek_moe(
    raw: dict[str, Any], defaults: dict[str, Any], architecture: str, num_layers: int
) -> MoeConfig | None:
    """DeepSeek's sparse MLP: every ``moe_layer_freq``-th layer from ``first_k_dense_replace``
    on, ungated shared experts, and the router its ``topk_method`` names (V2: softmax scores,
    top k of all experts or of the best groups by their best score; V3 and GLM-4.5: sigmoid
    scores with a correction bias, top k of the best groups by their best two scores)."""

    field = partial(_field, raw, defaults)

    num_experts = int(field("n_routed_experts"))
    first_dense = int(field("first_k_dense_replace"))
    frequency = int(field("moe_layer_freq"))
    if frequency < 1:
        raise ValueError(f"moe_layer_freq {frequency} must be at least 1")
    sparse_layers = tuple(i for i in range(first_dense, num_layers) if i % frequency == 0)
    if not sparse_layers or num_experts < 1:
        return None
    top_k_value = field("num_experts_per_tok")
    if top_k_value is None:
        raise ValueError("num_experts_per_tok is required for a model with sparse layers")
    top_k = int(top_k_value)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1 .. {num_experts} (the experts)")
    method = "noaux_tc" if architecture == _GLM4_MOE else str(field("topk_method"))
    if method not in _DEEPSEEK_TOPK_METHODS:
        raise ValueError(
            f"unsupported topk_method {method!r}; supported: {', '.join(_DEEPSEEK_TOPK_METHODS)}"
        )
    if architecture == _DEEPSEEK_V3 and method != "noaux_tc":
        raise ValueError(f"topk_method {method!r}: DeepSeek-V3 routes with 'noaux_tc' only")
    num_groups, top_groups = 1, 1
    if method != "greedy":
        num_groups, top_groups = int(field("n_group")), int(field("topk_group"))
        if num_groups < 1 or num_experts % num_groups != 0:
            raise ValueError(f"n_group {num_groups} must divide n_routed_experts {num_experts}")
        if not 1 <= top_groups <= num_groups:
            raise ValueError(f"topk_group {top_groups} must be in 1 .. {num_groups} (n_group)")
        if method == "noaux_tc" and num_experts // num_groups < 2:
            raise ValueError(
                f"n_group {num_groups}: noaux_tc scores a group by its best two experts, so "
                f"each group needs at least 2 of the {num_experts} experts"
            )
    moe_width = int(field("moe_intermediate_size"))
    shared_experts = int(field("n_shared_experts") or 0)
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=moe_width,
        normalize_top_k=bool(field("norm_topk_prob")),
        sparse_layers=sparse_layers,
        shared_expert_intermediate_size=moe_width * shared_experts,
        shared_expert_gated=False,
        scoring="sigmoid" if method == "noaux_tc" else "softmax",
        router_in_float32=True,
        num_groups=num_groups,
        top_groups=top_groups,
        group_score="top2_sum" if method == "noaux_tc" else "max",
        score_correction_bias=method == "noaux_tc",
        routed_scaling_factor=float(field("routed_scaling_factor")),
    )


def _parse_gpt_oss_moe(raw: dict[str, Any], defaults: dict[str, Any], num_layers: int) -> MoeConfig:
    """gpt-oss: every layer sparse, experts as wide as ``intermediate_size``, a biased router
    whose top k logits are softmaxed, and clamped-SwiGLU experts with biases."""

    field = partial(_field, raw, defaults)

    num_experts = int(field("num_local_experts"))
    top_k = int(field("num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1 .. {num_experts} (the experts)")
    limit = float(field("swiglu_limit"))
    if limit <= 0:
        raise ValueError(f"swiglu_limit {limit} must be positive")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=int(raw["intermediate_size"]),
        normalize_top_k=False,
        sparse_layers=tuple(range(num_layers)),
        shared_expert_intermediate_size=0,
        router_bias=True,
        softmax_after_top_k=True,
        expert_activation="clamped_swiglu",
        swiglu_alpha=float(field("swiglu_alpha")),
        swiglu_limit=limit,
    )


def _parse_minimax_m2_moe(
    raw: dict[str, Any], defaults: dict[str, Any], num_layers: int
) -> MoeConfig:
    """MiniMax-M2: every layer sparse, experts as wide as ``intermediate_size``, sigmoid scores
    with a correction bias choosing the top k of all experts (in the model's dtype), weighted
    by their scores renormalised; no shared expert."""

    field = partial(_field, raw, defaults)

    num_experts = int(field("num_local_experts"))
    top_k = int(field("num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1 .. {num_experts} (the experts)")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=int(raw["intermediate_size"]),
        normalize_top_k=True,
        sparse_layers=tuple(range(num_layers)),
        shared_expert_intermediate_size=0,
        scoring="sigmoid",
        score_correction_bias=True,
    )
