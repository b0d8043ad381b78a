"""Whether a model's own multi-token-prediction layer can draft (``"method": "mtp"``), checked
before anything loads; torch-free, so the router refuses a bad configuration at start too."""

from __future__ import annotations

from engine.model_config import ModelConfig
from engine.quantization.config import Fp8BlockWeights

_FAMILIES = "DeepSeek-V3 (DeepseekV3ForCausalLM) and GLM-4.5 (Glm4MoeForCausalLM)"


def check_prediction_layer(target: ModelConfig) -> None:
    """Raise ValueError naming the field where the prediction layer cannot draft: the model
    has none, or it would run where it does not yet (its cache slot is one more of the
    model's, whose layers must all attend to the whole context; of quantized checkpoints, it
    reads DeepSeek-V3's published layout: its decoder layer in FP8 blocks as the model's,
    ``eh_proj`` and the head in floating point)."""
    if target.num_prediction_layers < 1:
        raise ValueError(
            f"speculative_config.method 'mtp' drafts with the model's multi-token-prediction "
            f"layers; {target.architecture} has none (config.json's num_nextn_predict_layers "
            f"is 0 or absent; layers are read for {_FAMILIES})"
        )
    quantization = target.quantization
    if quantization is not None and not isinstance(quantization, Fp8BlockWeights):
        raise ValueError(
            "speculative_config.method 'mtp' with a quantized checkpoint reads block-wise FP8 "
            "(config.json's quantization_config.quant_method 'fp8', DeepSeek-V3's release) for "
            f"now, got {quantization.describe()}"
        )
    if target.cache_groups.num_groups > 1 or any(target.cache_groups.windows):
        raise ValueError(
            "speculative_config.method 'mtp' needs a model whose layers all attend to the "
            "whole context (sliding_window / layer_types)"
        )
