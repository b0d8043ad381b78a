"""What a model's multi-token-prediction layer drafts, computed with transformers' modules on the
checkpoint's weights, the whole context recomputed for every draft (no cache): the target's
final hidden states (after its final norm) at each position, the layer over every position of
the sequence (the token after each, the hidden state there), then each further draft at the
next position, the layer's own output standing in for the target's state. With a quantized KV
cache's scales, every layer's K/V (the prediction layer's, the last scales) go through the
quantized cache's store and read back (tests/engine/quantized_kv_reference.py)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.kv_cache.kv_quantization import KVCacheScales
from tests.engine.hf_reference import hf_model
from tests.engine.quantized_kv_reference import quantizing_cache


@cache
def _with_prediction_layer(model_dir: Path) -> torch.nn.Module:
    """transformers' model of one more layer: its last is the prediction layer's decoder layer."""
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = config["num_hidden_layers"] + 1
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, num_hidden_layers=num_layers
    )
    return model.eval()


@cache
def _prediction_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    config = json.loads((model_dir / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    tensors = load_file(model_dir / "model.safetensors")
    return {
        name[len(prefix) :]: t.float() for name, t in tensors.items() if name.startswith(prefix)
    }


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_drafts(
    model_dir: Path,
    token_ids: list[int],
    num_drafts: int,
    kv_scales: KVCacheScales | None = None,
) -> list[int]:
    """The drafts the prediction layer makes after ``token_ids`` (greedy)."""

    def cache(config: object) -> object:  # of the K/V a forward stores and reads back
        return None if kv_scales is None else quantizing_cache(config, kv_scales)

    target = hf_model(model_dir)
    extended = _with_prediction_layer(model_dir)
    layer = extended.model.layers[-1]
    weights = _prediction_tensors(model_dir)
    eps = extended.config.rms_norm_eps
    with torch.no_grad():
        given = torch.tensor([token_ids])
        states = target.model(given, past_key_values=cache(target.config)).last_hidden_state[0]
        inputs = list(token_ids[1:])  # the token after each position
        hidden = [states[p] for p in range(len(token_ids) - 1)]
        drafts: list[int] = []
        for _ in range(num_drafts):
            ids = torch.tensor(inputs)
            embedded = _rms_norm(weights["embed_tokens.weight"][ids], weights["enorm.weight"], eps)
            normed = _rms_norm(torch.stack(hidden), weights["hnorm.weight"], eps)
            x = torch.cat([embedded, normed], dim=-1) @ weights["eh_proj.weight"].T
            n = x.shape[0]
            positions = torch.arange(n)[None]
            cos_sin = extended.model.rotary_emb(x[None], positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(
                x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin,
                past_key_values=cache(extended.config),
            )  # fmt: skip
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1]
            head = _rms_norm(last, weights["shared_head.norm.weight"], eps)
            draft = int((head @ weights["shared_head.head.weight"].T).argmax())
            drafts.append(draft)
            inputs.append(draft)
            hidden.append(last)
    return drafts
