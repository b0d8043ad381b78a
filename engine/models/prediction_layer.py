"""A checkpoint's multi-token-prediction layer (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers``
layers stored past the decoder's, as ``model.layers.{num_hidden_layers}.*``), the drafter of
speculative decoding's ``"method": "mtp"`` (engine/speculative/mtp.py).

At position p it takes the target model's final hidden state there (after the final norm) and
the embedding of the token at p + 1, and predicts the token at p + 2:
    h = eh_proj([enorm(embed(token p+1)), hnorm(hidden p)])
    h = a decoder layer of the model's own kind (its attention reading its own KV cache slot)
    logits = shared_head.head(shared_head.norm(h))
Drafting on, the ``h`` it gave at p stands in for the target's hidden state at p + 1.
Unlike vLLM, the embedding at position 0 is not zeroed: the layer was trained on it.

Under tensor parallelism every rank holds its shard of the layer as it holds the decoder's
(its heads, its MLP columns or experts, its vocabulary rows of the embeddings and the head;
``eh_proj`` and the norms whole) and runs each of the layer's forwards rank 0 runs
(engine/parallel/follower.py). Its KV cache is one more slot of the target's cache (the slot
after the decoder's, of the rank's heads), so its blocks are the target's: allocated, cached,
swapped and handed off with them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model_config import ModelConfig, parse_model_config
from engine.models.llama import DecoderLayer, VocabParallelEmbedding
from engine.models.rms_norm import rms_norm_for
from engine.models.rope import RotaryEmbedding
from engine.parallel.group import SingleRank, TensorParallelGroup
from engine.parallel.shard import TensorParallelShard


class SharedHead(nn.Module):
    """The layer's output norm and its logits projection (the checkpoint's own copy), of the
    shard's vocabulary rows."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        super().__init__()
        self.norm = rms_norm_for(config, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, shard.vocab_rows, bias=False)


class PredictionLayer(DecoderLayer):
    """A decoder layer with the inputs and the head of a multi-token-prediction layer."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        shard: TensorParallelShard,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__(config, layer_idx, shard, group)
        self.embed_tokens = VocabParallelEmbedding(config, shard, group)
        self.enorm = rms_norm_for(config, config.hidden_size)
        self.hnorm = rms_norm_for(config, config.hidden_size)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config, shard)


class _Layers(nn.Module):
    """The checkpoint's ``model.layers``, of which the prediction layer's index alone."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)


class MultiTokenPredictor(nn.Module):
    """The checkpoint's first prediction layer, named as the checkpoint names it
    (``model.layers.{num_hidden_layers}``), which drafts every token (as vLLM runs DeepSeek-V3's
    one layer). Runs inside set_forward_context() on the target's KV cache: its attention
    reads and writes the slot after the decoder's."""

    def __init__(
        self,
        config: ModelConfig,
        shard: TensorParallelShard | None = None,  # None: the whole layer, on one rank
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        # ``config``: the model's, counting its prediction layers among its layers (so the
        # prediction layer's MLP is sparse where the model's pattern makes it, and its cache
        # slot is the one after the decoder's); the loader reads shard and config here
        self.config = config
        self.shard = shard if shard is not None else TensorParallelShard.whole(config)
        self.group = group if group is not None else SingleRank()
        self.layer_idx = config.num_layers - config.num_prediction_layers
        layer = PredictionLayer(config, self.layer_idx, self.shard, self.group)
        self.model = _Layers({str(self.layer_idx): layer})
        self.rotary_emb = RotaryEmbedding(
            config.rope_dim, config.max_position_embeddings, config.rope
        )

    @property
    def layer(self) -> PredictionLayer:
        layer = self.model.layers[str(self.layer_idx)]
        assert isinstance(layer, PredictionLayer)
        return layer

    def forward(
        self,
        next_token_ids: torch.Tensor,  # [n] int64: the token after each position
        positions: torch.Tensor,  # [n] int64
        hidden: torch.Tensor,  # [n, hidden_size]: the target's final hidden state at each
    ) -> torch.Tensor:  # [n, hidden_size]: what predicts the token after the next one
        layer = self.layer
        embedded = layer.enorm(layer.embed_tokens(next_token_ids))
        joined = layer.eh_proj(torch.cat([embedded, layer.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary_emb(positions, joined.dtype)
        return layer(joined, cos, sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] fp32
        """Over the whole vocabulary, on every rank (a collective under tensor parallelism)."""
        head = self.layer.shared_head
        logits = head.head(head.norm(hidden))  # [n, vocab_rows]
        if self.group.size > 1:  # [n, size * vocab_rows], padding rows last
            logits = self.group.all_gather(logits)[:, : self.config.vocab_size]
        return logits.float()


def prediction_layer_config(model_dir: str | Path) -> ModelConfig:
    """The model's config (``model_dir``'s config.json) with its prediction layers counted among
    its layers."""
    raw: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    num_layers = int(raw["num_hidden_layers"]) + int(raw.get("num_nextn_predict_layers") or 0)
    return parse_model_config({**raw, "num_hidden_layers": num_layers})
