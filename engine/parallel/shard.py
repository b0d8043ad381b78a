"""Which slice of a model one tensor-parallel rank holds: its heads, MLP columns and vocab rows.

Torch-free, so the engine's configuration checks and the KV-transfer layout can use it.
Query heads, the MLP's intermediate columns (and each expert's, and the shared expert's, in a
mixture-of-experts model: every rank holds every expert's slice) and the vocabulary split
evenly over the ranks.
With expert parallelism (``expert_parallel``, vLLM's ``--enable-expert-parallel``) a
mixture-of-experts model's routed experts are dealt out whole instead: each rank holds a
contiguous run of them, ``num_experts // size`` or one more (the first ranks take the
remainder), every column of each; the shared expert and the rest split as above. A
checkpoint's expert width then need not divide by the ranks, nor its quantized blocks.
KV heads split evenly too, unless there are more ranks than KV heads: then each rank holds
the one KV head its query heads read, replicated on ``size // num_kv_heads`` ranks (as vLLM
does). The vocabulary is padded to ``size * vocab_rows`` rows; padding rows hold zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.quantization.config import Mxfp4ExpertWeights


@dataclass(frozen=True, slots=True)
class TensorParallelShard:
    rank: int  # this rank, 0 .. size - 1
    size: int  # number of ranks (tensor_parallel_size)
    q_heads: range  # query heads this rank computes, num_heads // size of them
    kv_heads: range  # KV heads it holds (its KV cache's heads); see the module docstring
    intermediate: range  # its columns of the MLP, intermediate_size // size of them
    experts: range  # the routed experts it holds (all of them unless expert_parallel)
    expert_intermediate: range  # its columns of each routed expert's MLP (empty: dense model)
    shared_expert_intermediate: range  # its columns of the shared expert's MLP (empty: none)
    vocab: range  # its rows of the embedding and the LM head; may end past vocab_size
    vocab_rows: int  # ceil(vocab_size / size), the same on every rank
    expert_parallel: bool = False  # routed experts dealt out whole (see the module docstring)

    @classmethod
    def of(
        cls, config: ModelConfig, rank: int, size: int, expert_parallel: bool = False
    ) -> TensorParallelShard:
        """Rank ``rank``'s slice of ``config``'s model over ``size`` ranks.

        Raises ValueError naming the field and the numbers when ``size`` cannot split it.
        """
        check_tensor_parallel_size(config, size, expert_parallel)
        if not 0 <= rank < size:
            raise ValueError(
                f"rank {rank} must be in 0 .. {size - 1} (tensor_parallel_size {size})"
            )
        q_per_rank = config.num_heads // size
        inter_per_rank = config.intermediate_size // size
        vocab_rows = -(-config.vocab_size // size)
        moe = config.moe
        experts = range(moe.num_experts if moe else 0)
        expert_columns = range(moe.expert_intermediate_size if moe else 0)
        if expert_parallel and moe:
            experts = rank_experts(moe.num_experts, rank, size)
        elif moe:
            width = moe.expert_intermediate_size // size
            expert_columns = range(rank * width, (rank + 1) * width)
        shared_width = moe.shared_expert_intermediate_size // size if moe else 0
        return cls(
            rank=rank,
            size=size,
            q_heads=range(rank * q_per_rank, (rank + 1) * q_per_rank),
            kv_heads=rank_kv_heads(config.num_kv_heads, rank, size),
            intermediate=range(rank * inter_per_rank, (rank + 1) * inter_per_rank),
            experts=experts,
            expert_intermediate=expert_columns,
            shared_expert_intermediate=range(rank * shared_width, (rank + 1) * shared_width),
            vocab=range(rank * vocab_rows, (rank + 1) * vocab_rows),
            vocab_rows=vocab_rows,
            expert_parallel=expert_parallel and moe is not None,
        )

    @classmethod
    def whole(cls, config: ModelConfig) -> TensorParallelShard:
        """The one rank of an unsharded model."""
        return cls.of(config, 0, 1)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's KV cache holds."""
        return len(self.kv_heads)

    @property
    def holds_expert_down_bias(self) -> bool:
        """Whether this rank adds its experts' down-projection biases (gpt-oss): each is added
        once over the all-reduce, so by rank 0 where every rank holds every expert's columns,
        and by the one rank holding the expert under expert parallelism."""
        return self.expert_parallel or self.rank == 0


def kv_heads_of_ranks(config: ModelConfig, size: int) -> tuple[range, ...]:
    """The model's KV heads each of ``size`` ranks holds, rank 0 first."""
    return tuple(TensorParallelShard.of(config, rank, size).kv_heads for rank in range(size))


def check_tensor_parallel_size(
    config: ModelConfig, size: int, expert_parallel: bool = False
) -> None:
    """Raises ValueError naming the field when ``size`` ranks cannot split the model (its
    routed experts dealt out whole with ``expert_parallel``)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size {size} must be at least 1")
    if config.num_heads % size != 0:
        raise ValueError(
            f"tensor_parallel_size {size} must divide num_attention_heads {config.num_heads}"
        )
    num_kv_heads = config.num_kv_heads
    if size <= num_kv_heads and num_kv_heads % size != 0:
        raise ValueError(
            f"tensor_parallel_size {size} must divide num_key_value_heads {num_kv_heads}"
        )
    if size > num_kv_heads and size % num_kv_heads != 0:
        raise ValueError(
            f"tensor_parallel_size {size} must be a multiple of num_key_value_heads "
            f"{num_kv_heads} (ranks beyond the KV heads replicate them)"
        )
    if config.intermediate_size % size != 0:
        raise ValueError(
            f"tensor_parallel_size {size} must divide intermediate_size {config.intermediate_size}"
        )
    moe = config.moe
    if moe is not None and expert_parallel and moe.num_experts < size:
        raise ValueError(
            f"tensor_parallel_size {size} with expert parallelism must be at most the "
            f"routed experts, num_experts {moe.num_experts} (each rank holds at least one)"
        )
    if moe is not None and not expert_parallel and moe.expert_intermediate_size % size != 0:
        raise ValueError(
            f"tensor_parallel_size {size} must divide moe_intermediate_size "
            f"{moe.expert_intermediate_size} (or deal the experts out whole: expert "
            "parallelism)"
        )
    mxfp4 = config.quantization if isinstance(config.quantization, Mxfp4ExpertWeights) else None
    width = 0 if moe is None else moe.expert_intermediate_size // size  # a rank's columns
    if moe is not None and mxfp4 is not None and not expert_parallel and width % mxfp4.group_size:
        raise ValueError(
            f"tensor_parallel_size {size} leaves each rank {width} of every expert's "
            f"{moe.expert_intermediate_size} columns: MXFP4 experts split at runs of "
            f"{mxfp4.group_size} inputs (quantization_config quant_method mxfp4); choose a size "
            "that keeps whole runs, or deal the experts out whole (expert parallelism)"
        )
    if moe is not None and moe.shared_expert_intermediate_size % size != 0:
        raise ValueError(
            f"tensor_parallel_size {size} must divide shared_expert_intermediate_size "
            f"{moe.shared_expert_intermediate_size}"
        )


def rank_kv_heads(num_kv_heads: int, rank: int, size: int) -> range:
    """The KV heads rank ``rank`` of ``size`` holds of ``num_kv_heads`` (see the module
    docstring); the size must split them (``check_tensor_parallel_size``)."""
    if size <= num_kv_heads:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // size  # the head of this rank's query heads
    return range(head, head + 1)


def rank_experts(num_experts: int, rank: int, size: int) -> range:
    """The routed experts rank ``rank`` of ``size`` holds under expert parallelism: a
    contiguous run, the first ``num_experts % size`` ranks one more than the rest."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
