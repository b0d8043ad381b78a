"""What the engine needs to know about a model, parsed from a Hugging Face model directory.

DeepSeek-V2/V3 attend with multi-head latent attention (``MlaConfig``): their KV cache holds one
latent vector per token and layer, which ``num_kv_heads`` (1), ``head_dim`` (its width) and
``kv_planes`` (1, against K and V's 2) describe to the cache, the allocator and the hand-off.

A mixture-of-experts model's sparse MLP is parsed by engine/moe_config.py (``MoeConfig``).

Only ``config.json`` (and ``generation_config.json`` for extra EOS ids) is read; transformers
is not needed. Both the classic keys (``rope_theta`` + ``rope_scaling``) and the
transformers-v5 ``rope_parameters`` dict are accepted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.kv_cache.cache_groups import CacheGroups, cache_groups_for
from engine.moe_config import MoeConfig, parse_moe
from engine.quantization.config import (
    Mxfp4ExpertWeights,
    PackedIntWeights,
    W8A8Weights,
    WeightQuantization,
    parse_quantization_config,
)
from engine.quantization.kv_cache_scheme import CheckpointKVScheme, parse_kv_cache_scheme
from engine.quantization.router_gates import require_gates_ignored
from engine.rope_config import RopeConfig, gemma3_ropes, parse_rope, yarn_mscale

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
)
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# GLM-4.5: multi-head attention (GQA, half the head dims rotary) with DeepSeek-V3's sparse MLP
_GLM4_MOE = "Glm4MoeForCausalLM"
# architectures whose multi-token-prediction layers (engine/speculative/prediction_layer.py) draft
_WITH_PREDICTION_LAYERS = ("DeepseekV3ForCausalLM", _GLM4_MOE)
# transformers' partial_rotary_factor where config.json gives none, for the architectures whose
# attention rotates only a head's first dims (the others rotate all of them)
_MINIMAX_M2 = "MiniMaxM2ForCausalLM"
_DEFAULT_PARTIAL_ROTARY = {"Phi3ForCausalLM": 1.0, _GLM4_MOE: 0.5, _MINIMAX_M2: 1.0}

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
}
# transformers' defaults when config.json omits the key
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "MixtralForCausalLM": 4096 * 32,
    "Qwen2MoeForCausalLM": 32768,
    "Qwen3MoeForCausalLM": 32768,
    "Phi3ForCausalLM": 4096,
    "DeepseekV2ForCausalLM": 2048,
    "DeepseekV3ForCausalLM": 4096,
    "Gemma2ForCausalLM": 8192,
    "Gemma3ForCausalLM": 131072,
    "GptOssForCausalLM": 131072,
    "Glm4MoeForCausalLM": 131072,
    "MiniMaxM2ForCausalLM": 196608,
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' rope base and norm epsilon when config.json gives none (10000 and 1e-6 for the
# others)
_DEFAULT_ROPE_THETA = {
    "MixtralForCausalLM": 1e6,
    "Gemma3ForCausalLM": 1e6,
    "GptOssForCausalLM": 150000.0,
    "MiniMaxM2ForCausalLM": 5000000.0,
}
_DEFAULT_RMS_NORM_EPS = {
    "MixtralForCausalLM": 1e-5,
    "Phi3ForCausalLM": 1e-5,
    "GptOssForCausalLM": 1e-5,
    "Glm4MoeForCausalLM": 1e-5,
}


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Keys and values of every head are
    projected up from one latent vector per token (``kv_lora_rank`` wide), which the KV cache
    holds together with the token's rotary key part (``qk_rope_head_dim``, shared by the
    heads). A query head has ``qk_nope_head_dim`` dims matched against the latent's up
    projection and ``qk_rope_head_dim`` rotary ones; a value head ``v_head_dim``."""

    q_lora_rank: int | None  # the query's own low-rank bottleneck; None: one projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the checkpoint's rotary dims come in interleaved pairs (x0, x1), (x2, x3), ... rather
    # than in halves; the loader reorders their rows into halves
    rope_interleaved: bool
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale squared where it has one

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Elements of one token's cache entry: the latent, then its rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the gated MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads, MQA when 1); MLA: 1
    head_dim: int  # elements per head; MLA: of the cache's one latent entry per token
    rms_norm_eps: float
    max_position_embeddings: int  # the model's max context length
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q/k/v projections have a bias
    o_proj_bias: bool  # the output projection has a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool  # the MLP projections have a bias (Llama mlp_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json
    bos_token_id: int | None
    checkpoint_dtype: str  # dtype the checkpoint was saved in, e.g. "bfloat16"
    moe: MoeConfig | None = None  # the sparse MLP; None: every layer's MLP is dense
    # sliding-window attention: a token of these layers sees only the last sliding_window
    # positions, itself included (None and (): every layer sees the whole context)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    mla: MlaConfig | None = None  # latent attention (DeepSeek); None: multi-head attention
    # the first dims of each head that rope turns, the rest passing through (GLM-4.5: half of
    # them, partial_rotary_factor); None: all of head_dim
    rotary_dim: int | None = None
    # RMSNorm on q and on k over all their heads at once, before rope (MiniMax-M2: q_norm holds
    # num_heads * head_dim weights), rather than per head (qk_norm)
    qk_norm_across_heads: bool = False
    # Gemma's choices (the defaults are everyone else's):
    activation: str = "silu"  # of the gated MLP: "silu" | "gelu_tanh"
    # norms scale by (offset + weight), in float32 throughout (Gemma: 1, its weights start at 0)
    norm_weight_offset: float = 0.0
    # norms also after the attention and the MLP (before their residual adds), and the MLP's
    # input norm is its own (pre_feedforward_layernorm) rather than post_attention_layernorm
    sandwich_norms: bool = False
    embedding_multiplier: float = 1.0  # the embeddings are scaled by this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # the sliding-window layers' rope where it differs from the others' (Gemma 3's local base)
    local_rope: RopeConfig | None = None
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attention_logit_softcap: float | None = None  # Gemma 2: the same on attention's logits
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (AttentionBackend)
    # norms scale in float32 before the cast back (gpt-oss), rather than after it
    norm_scale_in_float32: bool = False
    # the decoder's linear layers hold packed integer weights (quantization_config); None: floats
    quantization: WeightQuantization | None = None
    # what the checkpoint's KV cache scales (k_scale / v_scale) are for, when its
    # quantization_config says (kv_cache_scheme); None: not said
    kv_cache_scheme: CheckpointKVScheme | None = None
    # multi-token-prediction layers the checkpoint holds past the decoder's (DeepSeek-V3's and
    # GLM-4.5's num_nextn_predict_layers): speculative decoding's "mtp" method drafts with them
    num_prediction_layers: int = 0

    @property
    def kv_planes(self) -> int:
        """What the KV cache holds per layer and block: K and V (2), or MLA's latent (1)."""
        return 1 if self.mla is not None else 2

    @property
    def rope_dim(self) -> int:
        """Dims of a head that rotary embeddings turn."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def cache_groups(self) -> CacheGroups:
        """The layers that share a block table (engine/kv_cache/cache_groups.py): one group of
        all of them unless sliding and full layers mix."""
        return cache_groups_for(self.num_layers, self.sliding_window, self.sliding_layers)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found: is {model_dir} a Hugging Face model dir?"
        )
    raw = json.loads(config_path.read_text())
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    return parse_model_config(raw, generation)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Build a ModelConfig from the dicts of config.json and generation_config.json."""
    architecture = _architecture(raw)
    hidden_size = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    max_positions = int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[architecture])
    _check_unsupported_features(raw, architecture)
    gemma = architecture in _GEMMA
    if architecture == "Gemma3ForCausalLM":
        rope, local_rope = gemma3_ropes(raw, max_positions)
    else:
        rope = parse_rope(raw, max_positions, _DEFAULT_ROPE_THETA.get(architecture, 10000.0))
        local_rope = None
    mla = _parse_mla(raw, rope) if architecture in _DEEPSEEK else None
    if mla is not None:  # the cache holds one latent entry per token, shared by the heads
        num_kv_heads, head_dim = 1, mla.latent_width
    else:
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads=}")
    num_layers = int(raw["num_hidden_layers"])
    sliding_window, sliding_layers = _sliding_layers(raw, architecture, num_layers, max_positions)
    attention_bias = bool(raw.get("attention_bias", architecture == "GptOssForCausalLM"))
    is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    glm = architecture == _GLM4_MOE
    is_qwen2_moe = architecture == "Qwen2MoeForCausalLM"
    moe = parse_moe(raw, architecture, num_layers)
    quantization = _parse_quantization(raw, architecture, moe, mla is not None)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS.get(architecture, 1e-6))),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        # Qwen2's q/k/v always have a bias; Qwen2-MoE's follow its qkv_bias key (default on)
        qkv_bias=bool(raw.get("qkv_bias", True)) if is_qwen2_moe else is_qwen2 or attention_bias,
        o_proj_bias=not (is_qwen2 or glm) and attention_bias,  # GLM-4.5: q/k/v's only
        mlp_bias=architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
        or (glm and bool(raw.get("use_qk_norm", False))),
        rope=rope,
        eos_token_ids=_eos_token_ids(raw, generation or {}),
        bos_token_id=_optional_int(raw.get("bos_token_id")),
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        moe=moe,
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        mla=mla,
        rotary_dim=None if mla is not None else _rotary_dim(raw, architecture, head_dim),
        qk_norm_across_heads=architecture == _MINIMAX_M2,
        activation="gelu_tanh" if gemma else "silu",
        norm_weight_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        embedding_multiplier=math.sqrt(hidden_size) if gemma else 1.0,
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        local_rope=local_rope,
        final_logit_softcap=_optional_float(
            raw.get(
                "final_logit_softcapping", 30.0 if architecture == "Gemma2ForCausalLM" else None
            )
        ),
        attention_logit_softcap=_optional_float(
            raw.get("attn_logit_softcapping", 50.0) if architecture == "Gemma2ForCausalLM" else None
        ),
        attention_sinks=architecture == "GptOssForCausalLM",
        norm_scale_in_float32=architecture == "GptOssForCausalLM",
        quantization=quantization,
        kv_cache_scheme=parse_kv_cache_scheme(raw.get("quantization_config")),
        num_prediction_layers=int(raw.get("num_nextn_predict_layers") or 0)
        if architecture in _WITH_PREDICTION_LAYERS
        else 0,
    )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if architectures:
        architecture = str(architectures[0])
    else:
        model_type = str(raw.get("model_type", ""))
        architecture = _ARCH_BY_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _parse_mla(raw: dict[str, Any], rope: RopeConfig) -> MlaConfig:
    """DeepSeek's latent attention sizes, and its softmax scale with yarn's correction."""
    q_lora_rank = _optional_int(raw.get("q_lora_rank", 1536))
    sizes = {
        key: int(raw.get(key, default))
        for key, default in (
            ("kv_lora_rank", 512),
            ("qk_nope_head_dim", 128),
            ("qk_rope_head_dim", 64),
            ("v_head_dim", 128),
        )
    }
    for key, value in (*sizes.items(), ("q_lora_rank", q_lora_rank)):
        if value is not None and value < 1:
            raise ValueError(f"{key} {value} must be at least 1")
    if sizes["qk_rope_head_dim"] % 2 != 0:
        raise ValueError(f"qk_rope_head_dim {sizes['qk_rope_head_dim']} must be even (rope pairs)")
    scale = (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]) ** -0.5
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if rope.scaling_type != "default" and mscale_all_dim:
        mscale = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
        scale = scale * mscale * mscale
    return MlaConfig(
        q_lora_rank=q_lora_rank,
        rope_interleaved=bool(raw.get("rope_interleave", True)),
        softmax_scale=scale,
        **sizes,
    )


def _parse_quantization(
    raw: dict[str, Any], architecture: str, moe: MoeConfig | None, latent_attention: bool
) -> WeightQuantization | None:
    """The checkpoint's weight quantization (engine/quantization/config.py), refused for the
    layers that cannot hold it: experts and latent attention hold FP8 blocks or packed
    integers (not the 8-bit W8A8 schemes), experts in input order (not GPTQ's activation
    order), and a compressed-tensors model's router gates stay float (its ``ignore`` names
    them, and a gated shared expert's gate)."""
    quantization = raw.get("quantization_config")
    if not quantization or _kv_cache_scheme_only(quantization):
        return None
    weights = parse_quantization_config(quantization, experts=moe is not None)
    unsupported = f"quantization_config ({weights.describe()}) is not supported for {architecture}"
    if isinstance(weights, Mxfp4ExpertWeights):
        if moe is None or moe.expert_activation != "clamped_swiglu":
            raise ValueError(f"{unsupported}: MXFP4 is read for gpt-oss's experts only")
        return weights
    if moe is None and not latent_attention:
        return weights
    if isinstance(weights, W8A8Weights):
        raise ValueError(
            f"{unsupported}: its experts and latent attention hold FP8 block-wise or packed "
            "integer weights (W4A16 / W8A16, AWQ, GPTQ) only"
        )
    if moe is None:
        return weights
    if moe.expert_activation != "silu":
        raise ValueError(
            f"{unsupported}: its clamped-SwiGLU experts run float or MXFP4 weights only"
        )
    if isinstance(weights, PackedIntWeights) and weights.act_order:
        raise ValueError(
            f"{unsupported}: quantization_config.desc_act true (GPTQ's activation order) is "
            "not supported for experts"
        )
    if weights.method == "compressed-tensors":
        gated_shared = moe.shared_expert_intermediate_size > 0 and moe.shared_expert_gated
        require_gates_ignored(quantization.get("ignore") or [], gated_shared, unsupported)
    return weights


def _kv_cache_scheme_only(quantization: Any) -> bool:
    """A compressed-tensors config of KV cache scales alone: float weights."""
    return (
        isinstance(quantization, dict)
        and quantization.get("quant_method") == "compressed-tensors"
        and quantization.get("kv_cache_scheme") is not None
        and not quantization.get("config_groups")
    )


def _check_unsupported_features(raw: dict[str, Any], architecture: str) -> None:
    if architecture in _GEMMA:
        activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"unsupported hidden_activation {activation!r}: Gemma runs 'gelu_pytorch_tanh'"
            )
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention true is not supported (a decoder only)")
        if raw.get("attention_bias"):
            raise ValueError("attention_bias true is not supported for Gemma")
    elif architecture != "GptOssForCausalLM":  # gpt-oss's hidden_act names no layer it runs
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is implemented")
    if architecture in _DEEPSEEK and raw.get("attention_bias", False):
        raise ValueError("attention_bias true is not supported for DeepSeek's latent attention")


def _rotary_dim(raw: dict[str, Any], architecture: str, head_dim: int) -> int | None:
    """The first dims of a head that rope turns (``partial_rotary_factor`` of them, at the top
    level of config.json or in its rope parameters, or MiniMax-M2's ``rotary_dim``); None for
    all of them. Refused, naming the field, for an architecture whose attention rotates every
    dim."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None and raw.get("rotary_dim") is not None:  # MiniMax-M2's published key
        factor = int(raw["rotary_dim"]) / head_dim
    if factor is None:
        factor = _DEFAULT_PARTIAL_ROTARY.get(architecture, 1.0)
    factor = float(factor)
    if factor == 1.0:
        return None
    if architecture not in _DEFAULT_PARTIAL_ROTARY:
        raise ValueError(
            f"partial_rotary_factor {factor} is not supported for {architecture} (its attention "
            f"rotates every dim); supported for {', '.join(_DEFAULT_PARTIAL_ROTARY)}"
        )
    rotary_dim = int(head_dim * factor)
    if not 0 < factor < 1 or rotary_dim < 2 or rotary_dim % 2 != 0:
        raise ValueError(
            f"partial_rotary_factor {factor} of head_dim {head_dim} turns {rotary_dim} dims; "
            "rope needs an even number of them, at least 2 and at most head_dim"
        )
    return rotary_dim


def _sliding_layers(
    raw: dict[str, Any], architecture: str, num_layers: int, max_positions: int
) -> tuple[int | None, tuple[int, ...]]:
    """The window transformers would apply, following its config defaults, and the layers it
    applies to; (None, ()) for none, or a window no shorter than the model's context."""
    window: Any = None
    sliding = [True] * num_layers
    if architecture in ("MixtralForCausalLM", "Phi3ForCausalLM"):
        window = raw.get("sliding_window")
    elif architecture == "MistralForCausalLM":
        window = raw.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
    elif architecture in (*_GEMMA, "GptOssForCausalLM"):
        # Gemma 3: 5 local layers to 1 global unless listed; Gemma 2 and gpt-oss: 1 to 1
        window = raw.get("sliding_window", 128 if architecture == "GptOssForCausalLM" else 4096)
        layer_types = raw.get("layer_types")
        default_pattern = 6 if architecture == "Gemma3ForCausalLM" else 2
        pattern = int(raw.get("sliding_window_pattern") or default_pattern)
        sliding = (
            [kind == "sliding_attention" for kind in layer_types]
            if layer_types
            else [(i + 1) % pattern != 0 for i in range(num_layers)]
        )
    elif raw.get("use_sliding_window", False):  # the Qwen families
        window = raw.get("sliding_window", 4096)
        max_window_layers = int(raw.get("max_window_layers", 28))
        layer_types = raw.get("layer_types")
        if layer_types:
            sliding = [kind == "sliding_attention" for kind in layer_types]
        elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            sliding = [i >= max_window_layers for i in range(num_layers)]
        elif architecture == "Qwen2MoeForCausalLM":
            sliding = [(i + 1) % 2 == 1 and i < max_window_layers for i in range(num_layers)]
    if not window or int(window) >= max_positions or not any(sliding):
        return None, ()
    if int(window) < 1:
        raise ValueError(f"sliding_window {window} must be at least 1")
    return int(window), tuple(i for i, is_sliding in enumerate(sliding) if is_sliding)


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    token_ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in token_ids:
                token_ids.append(int(token_id))
    return tuple(token_ids)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
