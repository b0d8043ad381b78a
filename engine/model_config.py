"""What the engine needs to know about a model, parsed from a Hugging Face model directory.

Only ``config.json`` (and ``generation_config.json`` for extra EOS ids) is read; transformers
is not needed. Both the classic keys (``rope_theta`` + ``rope_scaling``) and the
transformers-v5 ``rope_parameters`` dict are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' defaults when config.json omits the key
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float  # base of the inverse frequencies
    scaling_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float  # linear / llama3 scaling factor (1.0 for "default")
    low_freq_factor: float  # llama3 only
    high_freq_factor: float  # llama3 only
    original_max_position_embeddings: int  # llama3 only: pre-training context length


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
    _check_unsupported_features(raw, architecture, max_positions)
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_proj_bias=not is_qwen2 and attention_bias,
        mlp_bias=architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        rope=_parse_rope(raw, max_positions),
        eos_token_ids=_eos_token_ids(raw, generation or {}),
        bos_token_id=_optional_int(raw.get("bos_token_id")),
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
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


def _check_unsupported_features(raw: dict[str, Any], architecture: str, max_positions: int) -> None:
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is implemented")
    sliding_window = _effective_sliding_window(raw, architecture)
    if sliding_window is not None and sliding_window < max_positions:
        raise ValueError(
            f"sliding-window attention (sliding_window={sliding_window} < "
            f"max_position_embeddings={max_positions}) is not supported"
        )


def _effective_sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    """The window transformers would apply, following its config defaults."""
    if architecture == "MistralForCausalLM":
        window = raw.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
        return None if window is None else int(window)
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = raw.get("sliding_window", 4096)
        if not raw.get("use_sliding_window", False) or window is None:
            return None
        num_layers = int(raw["num_hidden_layers"])
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)
        ]
        return int(window) if "sliding_attention" in layer_types else None
    return None


def _parse_rope(raw: dict[str, Any], max_positions: int) -> RopeConfig:
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {params}")
    partial_rotary_factor = float(
        params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    )
    if partial_rotary_factor != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported ({partial_rotary_factor=})")
    scaling_type = str(params.get("rope_type", params.get("type", "default")))
    if scaling_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {scaling_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("factor", 1.0) if scaling_type != "default" else 1.0
    return RopeConfig(
        theta=float(theta),
        scaling_type=scaling_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_positions)
        ),
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
