"""config.json parsing: classic and transformers-v5 keys, defaults, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.model_config import SUPPORTED_ARCHITECTURES, load_model_config, parse_model_config
from engine.rope_config import RopeConfig
from tests.fixtures.tiny_models import tiny_hf_config


def _raw(architecture: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
    }
    raw.update(overrides)
    return raw


def test_defaults_follow_transformers() -> None:
    config = parse_model_config(_raw())
    assert config.num_kv_heads == 8 and config.head_dim == 32
    assert config.rope == RopeConfig(10000.0, "default", 1.0, 1.0, 4.0, 2048)
    assert not (config.qkv_bias or config.o_proj_bias or config.qk_norm or config.mlp_bias)
    assert config.tie_word_embeddings is False and config.bos_token_id is None


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_v5_saved_config_round_trips(tmp_path: Path, architecture: str) -> None:
    tiny_hf_config(architecture).save_pretrained(str(tmp_path))
    config = load_model_config(tmp_path)
    assert config.architecture == architecture
    latent = architecture.startswith("Deepseek")
    # latent attention caches one entry per token: the latent (32) and the rope key (8)
    heads = (4, 1, 40) if latent else (4, 2, 16)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == heads
    assert (config.mla is not None, config.kv_planes) == ((True, 1) if latent else (False, 2))
    # transformers' defaults, or the tiny configs' (Gemma 3's global layers')
    thetas = {
        "MixtralForCausalLM": 1e6,
        "Gemma3ForCausalLM": 1e6,
        "GptOssForCausalLM": 150000.0,
        "MiniMaxM2ForCausalLM": 5e6,
    }
    theta = thetas.get(architecture, 10000.0)
    scaling = {
        "Phi3ForCausalLM": "longrope",
        "DeepseekV3ForCausalLM": "yarn",
        "Gemma3ForCausalLM": "linear",
        "GptOssForCausalLM": "yarn",
    }
    assert config.rope.theta == theta
    assert config.rope.scaling_type == scaling.get(architecture, "default")
    # the tiny GLM-4.5 has q/k/v biases, q/k norms and rope on half of each head's 16 dims
    assert config.qkv_bias == architecture.startswith(("Qwen2", "GptOss", "Glm4Moe"))
    assert config.o_proj_bias == architecture.startswith("GptOss")
    assert config.qk_norm == architecture.startswith(("Qwen3", "Gemma3", "Glm4Moe"))
    half_rotary = architecture.startswith(("Glm4Moe", "MiniMaxM2"))
    assert config.rope_dim == (8 if latent or half_rotary else 16)
    assert config.qk_norm_across_heads == architecture.startswith("MiniMaxM2")
    sparse = (
        "Moe" in architecture
        or "Mixtral" in architecture
        or latent
        or "GptOss" in architecture
        or "MiniMax" in architecture
    )
    assert (config.moe is not None) == sparse
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_classic_rope_keys() -> None:
    scaling = {"type": "linear", "factor": 2.0}
    config = parse_model_config(_raw(rope_theta=1e6, rope_scaling=scaling))
    assert (config.rope.theta, config.rope.scaling_type, config.rope.factor) == (1e6, "linear", 2.0)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = parse_model_config(_raw(rope_theta=500000.0, rope_scaling=llama3)).rope
    assert rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)


def test_v5_rope_parameters() -> None:
    params = {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}
    rope = parse_model_config(_raw(rope_parameters=params)).rope
    assert (rope.theta, rope.scaling_type, rope.factor) == (5e5, "linear", 4.0)


def test_unsupported_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="dynamic.*default, linear, llama3, longrope, yarn"):
        parse_model_config(_raw(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_raw(eos_token_id=[2, 7])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_model_config(tmp_path).eos_token_ids == (2, 7, 9)


def test_biases_per_architecture() -> None:
    qwen2 = parse_model_config(_raw("Qwen2ForCausalLM"))
    assert qwen2.qkv_bias and not qwen2.o_proj_bias
    llama = parse_model_config(_raw(attention_bias=True, mlp_bias=True))
    assert llama.qkv_bias and llama.o_proj_bias and llama.mlp_bias


def test_architecture_from_model_type() -> None:
    raw = _raw()
    del raw["architectures"]
    assert parse_model_config({**raw, "model_type": "qwen3"}).architecture == "Qwen3ForCausalLM"


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match=", ".join(SUPPORTED_ARCHITECTURES)):
        parse_model_config(_raw("GemmaForCausalLM"))


@pytest.mark.parametrize(
    ("architecture", "overrides", "window", "layers"),
    [
        (
            "MistralForCausalLM",
            {"sliding_window": 4096, "max_position_embeddings": 32768},
            4096,
            (0, 1, 2, 3),
        ),
        (
            "MistralForCausalLM",
            {"max_position_embeddings": 32768},
            4096,
            (0, 1, 2, 3),
        ),  # absent key
        ("MixtralForCausalLM", {"sliding_window": 64}, 64, (0, 1, 2, 3)),
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 2},
            1024,
            (2, 3),  # from max_window_layers on
        ),
        (
            "Qwen3ForCausalLM",
            {
                "use_sliding_window": True,
                "sliding_window": 512,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            512,
            (0, 2),
        ),
        (
            "Qwen2MoeForCausalLM",
            {"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 3},
            256,
            (0, 2),  # odd-numbered layers (1-based) below max_window_layers
        ),
    ],
)
def test_sliding_windows_follow_transformers(
    architecture: str, overrides: dict[str, Any], window: int, layers: tuple[int, ...]
) -> None:
    config = parse_model_config(_raw(architecture, num_hidden_layers=4, **overrides))
    assert (config.sliding_window, config.sliding_layers) == (window, layers)


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("MistralForCausalLM", {"sliding_window": None, "max_position_embeddings": 32768}),
        ("MistralForCausalLM", {"sliding_window": 4096, "max_position_embeddings": 4096}),
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 1024}),
        ("LlamaForCausalLM", {"sliding_window": 16}),  # Llama has none
    ],
)
def test_inactive_sliding_window_is_accepted(architecture: str, overrides: dict[str, Any]) -> None:
    config = parse_model_config(_raw(architecture, **overrides))
    assert (config.sliding_window, config.sliding_layers) == (None, ())


def test_non_silu_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="gelu"):
        parse_model_config(_raw(hidden_act="gelu"))


def test_a_quantized_checkpoint_is_refused_naming_the_field() -> None:
    quantized = _raw(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []})
    with pytest.raises(ValueError, match="quantization_config .*mxfp4.* gpt-oss's experts only"):
        parse_model_config(quantized)
    quantized = _raw(quantization_config={"quant_method": "nf4"})
    with pytest.raises(ValueError, match="quantization_config.quant_method 'nf4' is not supported"):
        parse_model_config(quantized)
