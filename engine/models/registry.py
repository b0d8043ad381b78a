"""Maps a checkpoint's architecture name to the model class that runs it."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.model_config import SUPPORTED_ARCHITECTURES
from engine.models.llama import LlamaForCausalLM
from engine.parallel.shard import TensorParallelShard


class CausalLM(Protocol):
    """What the model runner calls on a model (inside set_forward_context). With a shard of
    several ranks both calls are collectives: every rank makes them with the same batch."""

    shard: TensorParallelShard  # the heads, MLP columns and vocab rows this rank holds

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor: ...  # [num_tokens, hidden_size], final norm applied

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, vocab] fp32


# Every supported architecture runs on the one flag-driven implementation.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    architecture: LlamaForCausalLM for architecture in SUPPORTED_ARCHITECTURES
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    model_class = _MODEL_CLASSES.get(architecture)
    if model_class is None:
        raise ValueError(
            f"unsupported architecture {architecture}; supported: {', '.join(_MODEL_CLASSES)}"
        )
    return model_class
