"""What a model costs per step, from its ``config.json`` alone (no weights): the bytes of its
weights, the FLOPs of one token through its layers, of one (query, key) pair of attention, and
the bytes of one token's KV cache.

Counted: the attention projections (multi-head, grouped-query, or DeepSeek's latent attention),
the gated MLPs (a mixture-of-experts layer stores every expert and computes its top k, plus its
shared expert), the embedding and the LM head (stored once when tied). Norms, biases and the
router's small matrices are left out (well under 1 % of any supported model). A step reads the
weights of the routed experts its tokens go to, not every expert's (the engine groups a step's
tokens by expert and runs only the experts that got some): ``weight_bytes_read``, the experts'
share taken as routing spreads tokens evenly (an upper bound on the experts touched: skewed
routing touches fewer). Of an input embedding stored apart from the LM head it reads its
tokens' rows (a lookup); the LM head it reads whole.

A quantized checkpoint (``quantization_config``, as the engine loads it) stores its decoder's
linear layers at its bits per weight, scales and zero points shared in (4-bit groups of 128:
4.25 bits, 4.125 symmetric); the embedding and the LM head stay in ``dtype``. A quantized KV
cache (``kv_cache_dtype`` fp8_e4m3 or int8) stores a byte per element (its per-head scales left
out). FLOPs are counted alike either way; those the engine computes on 8-bit operands on a GPU
are counted apart (``eight_bit_flops_per_token``, of ``eight_bit_matmul``'s kind), for a device
whose int8 or float8 tensor cores are faster (hardware.py): the decoder's linear layers of a
W8A8 checkpoint (int8 or float8 inputs quantized per token) and of a block-wise FP8 one whose
blocks the GPU kernels take (engine/kernels/fp8_block_matmul.py). A weight-only checkpoint
(W4A16, AWQ, GPTQ) multiplies in ``dtype``: its gain is the bytes a step reads.

A model with sliding-window layers keeps their KV apart (engine/kv_cache/cache_groups.py): a
block holds one group's layers, a sequence's sliding groups keep its window's blocks alone, a
hand-off moves those, and a decode row of a sliding layer reads its window at most
(``cache_groups``, passed to the simulated workers' block managers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.kv_cache.cache_groups import CacheGroups
from engine.model_config import ModelConfig, load_model_config
from engine.quantization.config import (
    Fp8BlockWeights,
    Mxfp4ExpertWeights,
    W8A8Weights,
    WeightQuantization,
)

EightBitMatmul = Literal["int8", "fp8"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "int8": 1}
# a KV cache's element, by pdserve serve's --kv-cache-dtype ("auto": the model's dtype)
KV_CACHE_DTYPE_BYTES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class ModelCosts:
    name: str
    num_layers: int
    num_kv_heads: int  # of the KV cache (MLA: 1)
    weight_bytes: int  # every stored parameter
    flops_per_token: float  # matmuls of one token through the layers and the LM head
    attention_flops_per_pair: float  # one (query, key) pair, over all layers and heads
    kv_bytes_per_token: int
    activation_bytes_per_token: (
        int  # one token's hidden state (what a tensor-parallel all-reduce moves)
    )
    max_model_len: int
    # how the weights are stored: "bfloat16", or the checkpoint's quantization described
    weights_stored_as: str = ""
    # of ``flops_per_token``, those whose matmuls take 8-bit operands on a GPU, and their kind
    # ("int8" or "fp8"; None: none do)
    eight_bit_flops_per_token: float = 0.0
    eight_bit_matmul: EightBitMatmul | None = None
    # mixture-of-experts models: of ``weight_bytes``, the routed experts' (every sparse layer's),
    # and how many a sparse layer has and routes each token to (0 and 0: a dense model)
    routed_expert_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    # which layers share a block table (sliding windows apart); None: one group of them all
    cache_groups: CacheGroups | None = None
    # an input embedding stored apart from the LM head (untied): of ``weight_bytes``, its
    # bytes, which a step reads a row of per token (a lookup), not whole; 0 when tied (the LM
    # head reads the one matrix whole)
    input_embedding_bytes: int = 0
    embedding_row_bytes: int = 0

    def kv_bytes_per_block(self, block_size: int) -> float:
        """A KV block's bytes: ``block_size`` tokens of the layers a block holds (every layer's,
        or, where sliding and full layers keep tables apart, one group's)."""
        slots = self.num_layers if self.cache_groups is None else self.cache_groups.num_slots
        return block_size * self.kv_bytes_per_token * slots / self.num_layers

    def weight_bytes_read(self, num_tokens: int) -> float:
        """The weight bytes a step of ``num_tokens`` tokens reads: all but the routed experts
        none of its tokens go to, each token going to ``experts_per_token`` of a sparse
        layer's ``num_experts`` at random (a given expert gets none with probability
        (1 - k/E)^tokens), and of an untied input embedding the rows of its tokens."""
        tokens = max(1, num_tokens)
        lookup = min(self.input_embedding_bytes, tokens * self.embedding_row_bytes)
        read = self.weight_bytes - self.input_embedding_bytes + lookup
        if not self.routed_expert_bytes:
            return float(read)
        untouched = (1 - self.experts_per_token / self.num_experts) ** tokens
        return read - self.routed_expert_bytes * untouched

    def describe(self) -> str:
        """E.g. ``weights 15.0 GiB (bfloat16), KV 128 KiB a token``."""
        stored = f" ({self.weights_stored_as})" if self.weights_stored_as else ""
        matmuls = ""
        if self.eight_bit_matmul is not None:
            share = self.eight_bit_flops_per_token / self.flops_per_token
            matmuls = f", {share:.0%} of its FLOPs in {self.eight_bit_matmul} matmuls"
        return (
            f"weights {self.weight_bytes / 2**30:.1f} GiB{stored}, "
            f"KV {self.kv_bytes_per_token / 2**10:g} KiB a token{matmuls}"
        )

    @classmethod
    def load(
        cls, model_dir: str | Path, dtype: str = "bfloat16", kv_cache_dtype: str = "auto"
    ) -> ModelCosts:
        return cls.of(load_model_config(model_dir), Path(model_dir).name, dtype, kv_cache_dtype)

    @classmethod
    def of(
        cls, config: ModelConfig, name: str, dtype: str = "bfloat16", kv_cache_dtype: str = "auto"
    ) -> ModelCosts:
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPE_BYTES)}; got {dtype!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_BYTES)}; "
                f"got {kv_cache_dtype!r}"
            )
        width = _DTYPE_BYTES[dtype]
        kv_width = KV_CACHE_DTYPE_BYTES[kv_cache_dtype] or width
        quantized = config.quantization
        linear_bits = 8 * width if quantized is None else quantized.stored_bits_per_weight
        routed_bits = linear_bits  # the routed experts'
        if isinstance(quantized, Mxfp4ExpertWeights):  # the experts alone quantized
            linear_bits = 8 * width
        hidden = config.hidden_size
        attention, attention_flops = _attention(config)
        linear = computed = 0  # the decoder's linear layers' parameters: stored, computed
        routed = 0  # of those stored, the routed experts'
        for layer in range(config.num_layers):
            layer_stored, layer_computed, layer_routed = _mlp(config, layer)
            linear += attention + layer_stored
            computed += attention + layer_computed
            routed += layer_routed
        embedding = config.vocab_size * hidden
        embeddings = embedding if config.tie_word_embeddings else 2 * embedding
        computed += embedding  # the LM head (the embedding is a lookup)
        kv_elements = config.kv_planes * config.num_kv_heads * config.head_dim
        eight_bit = None if quantized is None else eight_bit_matmul(quantized)
        return cls(
            name=name,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            weight_bytes=round((linear - routed) * linear_bits / 8 + routed * routed_bits / 8)
            + embeddings * width,
            flops_per_token=2.0 * computed,
            attention_flops_per_pair=attention_flops * config.num_layers,
            kv_bytes_per_token=config.num_layers * kv_elements * kv_width,
            activation_bytes_per_token=hidden * width,
            max_model_len=config.max_position_embeddings,
            weights_stored_as=dtype if quantized is None else quantized.describe(),
            # the decoder's linear layers (the LM head stays in ``dtype``)
            eight_bit_flops_per_token=0.0 if eight_bit is None else 2.0 * (computed - embedding),
            eight_bit_matmul=eight_bit,
            routed_expert_bytes=round(routed * routed_bits / 8),
            num_experts=0 if config.moe is None else config.moe.num_experts,
            experts_per_token=0 if config.moe is None else config.moe.num_experts_per_token,
            cache_groups=None if config.sliding_window is None else config.cache_groups,
            input_embedding_bytes=0 if config.tie_word_embeddings else embedding * width,
            embedding_row_bytes=hidden * width,
        )


def eight_bit_matmul(quantization: WeightQuantization) -> EightBitMatmul | None:
    """The 8-bit matmuls the engine runs a checkpoint's linear layers with on a GPU: W8A8's
    int8 or float8, block-wise FP8's float8 where its kernels take the blocks' inputs; None
    for weight-only checkpoints (their weights dequantized, the matmul in the model's dtype)."""
    if isinstance(quantization, W8A8Weights):
        return "int8" if quantization.kind == "int" else "fp8"
    if isinstance(quantization, Fp8BlockWeights) and _fp8_blocks_supported(quantization.block_cols):
        return "fp8"
    return None


def _fp8_blocks_supported(block_cols: int) -> bool:
    """engine/kernels/fp8_block_matmul.py's ``block_cols_supported`` (without Triton: the
    router does not import it): groups of a power of two >= 32 inputs."""
    return block_cols >= 32 and block_cols & (block_cols - 1) == 0


def _attention(config: ModelConfig) -> tuple[int, float]:
    """(parameters of one layer's attention projections, FLOPs of one (query, key) pair in one
    layer: the score and the weighted value, 2 per multiply-add). Latent attention's are the
    absorbed form's, the latent's width twice (its key up-projection and value up-projection
    count as the token's own matmuls, as ``kv_b_proj``'s parameters)."""
    hidden, heads = config.hidden_size, config.num_heads
    mla = config.mla
    if mla is None:
        head_dim = config.head_dim
        params = 2 * hidden * heads * head_dim + 2 * hidden * config.num_kv_heads * head_dim
        return params, 2.0 * heads * 2 * head_dim
    if mla.q_lora_rank is None:
        q = hidden * heads * mla.qk_head_dim
    else:
        q = hidden * mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
    kv = hidden * mla.latent_width + mla.kv_lora_rank * heads * (
        mla.qk_nope_head_dim + mla.v_head_dim
    )
    o = heads * mla.v_head_dim * hidden
    # absorbed, as the engine attends for every token (engine/models/mla.py): each head scores
    # the cached latent and its rotary key, and sums latents
    return q + kv + o, 2.0 * heads * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim)


def _mlp(config: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(parameters stored, parameters one token computes, of those stored the routed experts')
    of a layer's MLP."""
    hidden = config.hidden_size
    moe = config.moe
    if moe is None or layer not in moe.sparse_layers:
        dense = 3 * hidden * config.intermediate_size
        return dense, dense, 0
    expert = 3 * hidden * moe.expert_intermediate_size
    shared = 3 * hidden * moe.shared_expert_intermediate_size
    routed = moe.num_experts * expert
    return routed + shared, moe.num_experts_per_token * expert + shared, routed
