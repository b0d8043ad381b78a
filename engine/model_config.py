"""What the engine needs to know about a model, parsed from a Hugging Face model directory.

Only ``config.json`` (and ``generation_config.json`` for extra EOS ids) is read; transformers
is not needed. Both the classic keys (``rope_theta`` + ``rope_scaling``) and the
transformers-v5 ``rope_parameters`` dict are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
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
}
# transformers' rope base and norm epsilon when config.json gives none (10000 and 1e-6 for the
# others)
_DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1e6}
_DEFAULT_RMS_NORM_EPS = {"MixtralForCausalLM": 1e-5, "Phi3ForCausalLM": 1e-5}
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
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float  # base of the inverse frequencies
    scaling_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float  # linear / llama3 scaling factor (1.0 for "default")
    low_freq_factor: float  # llama3 only
    high_freq_factor: float  # llama3 only
    original_max_position_embeddings: int  # llama3, longrope: pre-training context length
    # longrope (Phi-3): per-frequency divisors for sequences within the pre-training length and
    # past it, and the scale of cos and sin (empty and 1.0 for the other types)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model: a router picks ``num_experts_per_token``
    of ``num_experts`` gated MLPs per token (softmax over the router's logits, then top-k)."""

    num_experts: int  # routed experts per sparse layer
    num_experts_per_token: int  # top-k
    expert_intermediate_size: int  # width of each routed expert's gated MLP
    normalize_top_k: bool  # the top-k probabilities are rescaled to sum to 1 (norm_topk_prob)
    sparse_layers: tuple[int, ...]  # layers whose MLP is sparse; the others keep the dense MLP
    # a gated MLP every token also runs, its output scaled by sigmoid(shared_expert_gate(x));
    # 0: none
    shared_expert_intermediate_size: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the gated MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads, MQA when 1)
    head_dim: int
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

    @property
    def all_layers_slide(self) -> bool:
        """Every layer's attention has the sliding window."""
        return self.sliding_window is not None and len(self.sliding_layers) == self.num_layers


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
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads=}")
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    max_positions = int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[architecture])
    _check_unsupported_features(raw)
    num_layers = int(raw["num_hidden_layers"])
    sliding_window, sliding_layers = _sliding_layers(raw, architecture, num_layers, max_positions)
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    is_qwen2_moe = architecture == "Qwen2MoeForCausalLM"
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v always have a bias; Qwen2-MoE's follow its qkv_bias key (default on)
        qkv_bias=bool(raw.get("qkv_bias", True)) if is_qwen2_moe else is_qwen2 or attention_bias,
        o_proj_bias=not is_qwen2 and attention_bias,
        mlp_bias=architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        rope=_parse_rope(raw, max_positions, _DEFAULT_ROPE_THETA.get(architecture, 10000.0)),
        eos_token_ids=_eos_token_ids(raw, generation or {}),
        bos_token_id=_optional_int(raw.get("bos_token_id")),
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        moe=_parse_moe(raw, architecture, num_layers),
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
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


def _parse_moe(raw: dict[str, Any], architecture: str, num_layers: int) -> MoeConfig | None:
    """The sparse MLP as transformers builds it for ``architecture`` (None for dense models)."""
    defaults = _MOE_DEFAULTS.get(architecture)
    if defaults is None:
        return None

    def field(key: str) -> Any:
        value = raw.get(key)
        return defaults[key] if value is None else value

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


def _check_unsupported_features(raw: dict[str, Any]) -> None:
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is implemented")


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


def _parse_rope(raw: dict[str, Any], max_positions: int, default_theta: float) -> RopeConfig:
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {params}")
    partial_rotary_factor = float(
        params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    )
    if partial_rotary_factor != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported ({partial_rotary_factor=})")
    scaling_type = str(params.get("rope_type", params.get("type", "default")))
    if scaling_type == "su":  # Phi-3's early name for it
        scaling_type = "longrope"
    if scaling_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {scaling_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    factor = params.get("factor", 1.0) if scaling_type != "default" else 1.0
    original_max = int(
        params.get(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", max_positions),
        )
    )
    rope = RopeConfig(
        theta=float(theta),
        scaling_type=scaling_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original_max,
    )
    if scaling_type == "longrope":
        return _longrope(rope, params, max_positions)
    return rope


def _longrope(rope: RopeConfig, params: dict[str, Any], max_positions: int) -> RopeConfig:
    """LongRoPE's factors, and its cos/sin scale as transformers derives it: from
    ``attention_factor``, else from the context's growth (``factor``, else max positions over
    the pre-training length)."""
    short, long = params.get("short_factor"), params.get("long_factor")
    if not isinstance(short, list) or not isinstance(long, list):
        raise ValueError("rope type 'longrope' needs the lists short_factor and long_factor")
    factor = params.get("factor")
    growth = float(factor) if factor else max_positions / rope.original_max_position_embeddings
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0
            if growth <= 1.0
            else math.sqrt(1 + math.log(growth) / math.log(rope.original_max_position_embeddings))
        )
    return dataclasses.replace(
        rope,
        factor=growth,
        short_factor=tuple(float(f) for f in short),
        long_factor=tuple(float(f) for f in long),
        attention_factor=float(attention_factor),
    )


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    token_ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in token_ids:
                token_ids.append(int(token_id))
    return tuple(token_ids)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
