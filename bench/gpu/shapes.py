"""bench.gpu's arithmetic: model shapes, run presets, roofline byte / FLOP counts.

No torch: a ``ModelSpec`` is written out as a Hugging Face ``config.json`` (the engine's dummy
load and transformers' ``from_config`` both build from it); its counts are what a step must read
or compute, from the shapes alone.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MIB = 1 << 20
GIB = 1 << 30
BLOCK_SIZE = 16  # KV cache block of the engine runs and the transfer layout, in tokens


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A Llama-architecture decoder, by its shapes."""

    name: str  # key in MODELS, used on the command line and in the JSON
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int
    intermediate_size: int  # width of the gated MLP
    vocab_size: int
    tie_word_embeddings: bool  # lm_head shares the embedding matrix

    def config_dict(self, max_positions: int, dtype: str) -> dict[str, Any]:
        """The ``config.json`` of this shape (rope theta as Llama 3, no rope scaling)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": min(128000, self.vocab_size - 2),
            "eos_token_id": min(128001, self.vocab_size - 1),
            "dtype": dtype,
        }

    def write_config(self, model_dir: Path, max_positions: int, dtype: str) -> Path:
        model_dir.mkdir(parents=True, exist_ok=True)
        path = model_dir / "config.json"
        path.write_text(json.dumps(self.config_dict(max_positions, dtype), indent=1))
        return model_dir

    # ---- counts --------------------------------------------------------------------------
    @property
    def linear_params(self) -> int:
        """Parameters of the per-token projections of all layers (q, k, v, o, gate, up, down)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)

    @property
    def num_params(self) -> int:
        """All parameters, the embedding counted once when tied (as the model holds them)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embeddings
        return self.linear_params + norms + embeddings + lm_head

    def decode_weight_bytes(self, dtype: str) -> int:
        """Weight bytes one decode step reads: projections, norms and the whole lm_head.

        The embedding lookup reads only the batch's rows, so an untied embedding table is left
        out; a tied one is read in full by the lm_head and counted there.
        """
        norms = (2 * self.num_layers + 1) * self.hidden_size
        lm_head = self.vocab_size * self.hidden_size
        return (self.linear_params + norms + lm_head) * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def prefill_flops(self, num_tokens: int) -> dict[str, int]:
        """FLOPs of one prompt's prefill: projections, causal attention, one lm_head row.

        Projections: 2 * linear_params per token. Attention per layer and head: QK^T and PV over
        the causal triangle, 2 * head_dim * T * (T + 1) in all. Logits: the last token only.
        """
        linear = 2 * self.linear_params * num_tokens
        attention = 2 * self.num_layers * self.num_heads * self.head_dim * num_tokens
        attention *= num_tokens + 1
        logits = 2 * self.vocab_size * self.hidden_size
        return {"linear": linear, "attention": attention, "logits": logits}


MODELS = {
    "8b": ModelSpec("8b", 4096, 32, 32, 8, 128, 14336, 128256, tie_word_embeddings=False),
    "1b": ModelSpec("1b", 2048, 16, 32, 8, 64, 8192, 128256, tie_word_embeddings=True),
    "tiny": ModelSpec("tiny", 64, 2, 4, 2, 16, 128, 512, tie_word_embeddings=False),
}


@dataclass(frozen=True, slots=True)
class Preset:
    """How much of everything one run measures."""

    models: tuple[str, ...]  # keys of MODELS, in run order
    batch_sizes: tuple[int, ...]  # decode batch sizes
    context_len: int  # prompt tokens of each decoding request
    prefill_lens: tuple[int, ...]  # one prompt each, timed alone
    num_warmup_steps: int  # decode steps run before timing
    num_decode_steps: int  # decode steps timed (median reported)
    num_prefill_reps: int  # timed prefills per length (median), after one warm-up
    hf_batch_size: int  # transformers baseline batch (compared with the same pdserve batch)
    hf_new_tokens: int  # tokens transformers decodes per request
    hf_continuous_batching: bool  # also try transformers' generate_batch
    transfer_tokens: tuple[int, ...]  # KV hand-off sizes for the transport measurement
    elementwise_tokens: tuple[int, ...]  # batch tokens of the elementwise torch-vs-fused runs
    copy_bytes: int  # size of the device-to-device copy ceiling
    matmul_n: int  # n of the n x n x n matmul ceiling
    num_reps: int  # repetitions of the ceilings and transfers (median)


PRESETS = {
    "full": Preset(
        models=("8b", "1b"),
        batch_sizes=(1, 8, 64, 256),
        context_len=1024,
        prefill_lens=(1024, 8192),
        num_warmup_steps=3,
        num_decode_steps=20,
        num_prefill_reps=3,
        hf_batch_size=64,
        hf_new_tokens=64,
        hf_continuous_batching=True,
        transfer_tokens=(1024, 8192),
        elementwise_tokens=(1, 64, 8192),
        copy_bytes=GIB,
        matmul_n=8192,
        num_reps=10,
    ),
    "tiny": Preset(
        models=("tiny",),
        batch_sizes=(1, 4, 8),
        context_len=64,
        prefill_lens=(64, 256),
        num_warmup_steps=2,
        num_decode_steps=5,
        num_prefill_reps=2,
        hf_batch_size=8,
        hf_new_tokens=8,
        hf_continuous_batching=True,
        transfer_tokens=(64, 256),
        elementwise_tokens=(1, 8),
        copy_bytes=64 * MIB,
        matmul_n=256,
        num_reps=3,
    ),
}


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """``num_tokens`` random token ids, clear of the vocabulary's first and last ten."""
    return [rng.randrange(10, vocab_size - 10) for _ in range(num_tokens)]


# the most important numbers in a shorter run: 8B only, batch 1 and 64, the 1k transfer
PRESETS["quick"] = replace(
    PRESETS["full"],
    models=("8b",),
    batch_sizes=(1, 64),
    num_decode_steps=15,
    num_prefill_reps=2,
    hf_new_tokens=32,
    hf_continuous_batching=False,
    transfer_tokens=(1024,),
    num_reps=5,
)
