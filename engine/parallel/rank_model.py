"""Builds what one rank of a worker holds: its model shard, its KV cache shard, the attention
backend that reads them, and (size 1 on CUDA) the decode graphs.

Every rank of a tensor-parallel worker calls ``build_rank_model`` with the same configs, so the
collectives in it (the group's join check, the memory profile's forward on CUDA, the agreed
number of KV blocks and of host-tier slots) line up rank by rank. Rank 0 builds its scheduler and runner on top
(engine/llm_engine.py); the others follow its steps (engine/parallel/follower.py). Rank 0
joins its group (``rank0_group``), or, changing role, keeps the one its followers run on and
tells them to rebuild.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from engine.attention.backend import AttentionBackend, DecodeSizing
from engine.attention.layer import set_kv_scales
from engine.attention.selector import get_attention_backend
from engine.decode_graphs import (
    CudaGraphCapturer,
    DecodeGraphs,
    capture_batch_sizes,
    max_decode_rows,
    use_decode_graphs,
)
from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kernels.linear import resolve_linear_backend
from engine.kv_cache.budget import KVLayout, num_host_kv_slots, num_kv_blocks
from engine.kv_cache.host_copies import host_cache_like
from engine.kv_cache.kv_quantization import KVCacheScales, storage_dtype
from engine.kv_calibration import (
    MAX_CALIBRATION_TOKENS,
    calibrate_kv_scales,
    calibration_token_ids,
)
from engine.memory_profile import decode_graph_bytes, peak_activation_bytes
from engine.model_config import ModelConfig, load_model_config
from engine.model_loader import load_model, load_prediction_layer, safetensors_files
from engine.models.llama import LlamaForCausalLM
from engine.models.prediction_layer import MultiTokenPredictor
from engine.models.registry import CausalLM
from engine.parallel.group import ProcessGroupRanks, TensorParallelGroup
from engine.parallel.shard import TensorParallelShard, kv_heads_of_ranks
from engine.parallel.step_commands import RebuildCommand, send_command
from engine.quantization.kv_cache_scheme import checkpoint_kv_scales
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_model import load_draft_model
from engine.speculative.mtp import MtpDrafter
from engine.speculative.proposer import Drafter


@dataclass(frozen=True, slots=True)
class RankModel:
    """What one rank computes with."""

    model_config: ModelConfig  # the whole model's config (every rank reads the same)
    shard: TensorParallelShard  # this rank's heads, MLP columns and vocabulary rows
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    model: CausalLM  # this rank's shard of the weights
    # [num_slots, kv_planes, num_blocks, block_size, shard.num_kv_heads, head_dim] (num_slots: the
    # model's layers, or its largest KV cache group's); num_blocks is the same on every rank
    kv_cache: torch.Tensor
    attn_backend: AttentionBackend
    decode_graphs: DecodeGraphs | None  # None: every step runs eagerly (always when size > 1)
    max_num_sample_rows: int  # rows of logits a step samples from at most
    # the process's torch threads before this rank took its share of the cores (None: kept)
    num_threads_before: int | None
    # a quantized cache's scales, the whole model's (this rank's attention layers hold their
    # heads' share); None: the cache stores the model's dtype
    kv_cache_scales: KVCacheScales | None = None
    # the host-memory tier's blocks, [num_host_slots, num_slots, kv_planes, block_size,
    # shard.num_kv_heads, head_dim] in the cache's dtype (page-locked beside a GPU cache);
    # num_host_slots is the same on every rank. None: no host tier (kv_offload_gb 0)
    host_kv_cache: torch.Tensor | None = None
    # how its weights were loaded (``_loaded_as``), for ``loaded_weights``
    loaded_as: tuple[str, str, int, str, str, str] | None = None
    # speculative decoding's draft model and its cache in the same blocks, or the model's
    # prediction layer, on rank 0 (None: neither; not kept for a next role: loaded again)
    drafter: Drafter | None = None
    # the model's prediction layer's shard (every rank's under tensor parallelism: each runs
    # the layer's forwards rank 0's drafter runs); None: speculative_config.method not "mtp"
    predictor: MultiTokenPredictor | None = None

    def loaded_weights(
        self, keep_kv_cache: bool = True, group: TensorParallelGroup | None = None
    ) -> LoadedWeights:
        """Its weights, for the engine of the role its worker takes next once its engine has
        stopped; with ``keep_kv_cache``, its KV cache too, which the next one may take: its
        engine must not step again, and nothing may write to its cache any more. A rank of
        several keeps its worker's ``group`` with them (its ranks rebuild together on it)."""
        if self.loaded_as is None:
            raise ValueError("these weights were not loaded by build_rank_model")
        if (group is None) != (self.shard.size == 1) or (group and group.size != self.shard.size):
            raise ValueError(
                f"a rank of {self.shard.size} keeps its weights with its group of as many ranks"
            )
        kept = KeptKVCache(self.kv_cache if keep_kv_cache else None)
        return LoadedWeights(
            cast(LlamaForCausalLM, self.model),
            self.loaded_as,
            kept,
            group,
            self.num_threads_before,
        )

    @property
    def num_kv_blocks(self) -> int:
        return int(self.kv_cache.shape[2])

    @property
    def num_host_slots(self) -> int:
        return 0 if self.host_kv_cache is None else int(self.host_kv_cache.shape[0])


class KeptKVCache:
    """A stopped engine's KV cache, held for the next engine of its worker: taken as it is when
    the next one's layout has its shape and dtype (its blocks' old contents are never read: the
    new block manager starts with every block free, as a freed block is reused), else let go.
    Allocating a cache touches every page of it: seconds for gigabytes on a busy CPU host."""

    def __init__(self, tensor: torch.Tensor | None) -> None:  # None: nothing kept
        self._tensor = tensor

    def take_if(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The cache if it is of ``shape``, ``dtype`` and on ``device``; either way no longer
        held here."""
        tensor, self._tensor = self._tensor, None
        if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            return None
        return tensor if tensor.device == device else None

    def release(self) -> None:
        self._tensor = None

    @property
    def held(self) -> bool:
        """Whether a cache is held (for the next engine to take)."""
        return self._tensor is not None


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A worker's model with its weights in memory, as it loaded them, and its KV cache: what it
    keeps when it changes role (router/rebalancer.py); its attention backend, graphs and (unless
    the kept one fits) KV cache are built anew for the other role's configs. A rank of a
    tensor-parallel worker keeps the worker's group too: every rank rebuilds on its own shard,
    in step (rank 0's engine tells its followers, engine/parallel/follower.py)."""

    model: LlamaForCausalLM  # this rank's shard of the weights
    loaded_as: tuple[str, str, int, str, str, str]  # (see ``_loaded_as``)
    kv_cache: KeptKVCache
    group: TensorParallelGroup | None = None  # the worker's ranks (None: one)
    # the process's torch threads before the ranks shared the cores (None: not shared)
    num_threads_before: int | None = None

    def check_loaded_as(
        self, load: LoadConfig, device: torch.device, dtype: torch.dtype, linear_backend: str
    ) -> None:
        """Raise ValueError unless these are the weights ``load`` would load."""
        wanted = _loaded_as(load, device, dtype, linear_backend)
        if wanted != self.loaded_as:
            raise ValueError(
                f"the weights kept were loaded as {self.loaded_as}, not as {wanted}: "
                "a worker keeps its weights only for the same model, dtype and device"
            )


def _collect_engine_before(device: torch.device) -> None:
    """Free what the stopped engine of this worker still holds: its objects refer to each other,
    so only a collection frees them (0.2-0.3 s with torch and transformers loaded); on a GPU,
    give the caching allocator's free blocks back too, so that what is allocated next is sized
    to the memory really free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _loaded_as(
    load: LoadConfig, device: torch.device, dtype: torch.dtype, linear_backend: str
) -> tuple[str, str, int, str, str, str]:
    """What decides a model's loaded weights: its directory, format, seed (random weights),
    device, dtype and linear layers' backend."""
    return (
        str(Path(load.model_dir).resolve()),
        load.load_format,
        load.seed,
        str(device),
        str(dtype),
        linear_backend,
    )


def rank_device(load: LoadConfig, rank: int) -> torch.device:
    """The device of ``rank``: the configured one for rank 0, the next visible CUDA devices
    after it (round the visible ones: a process that sees one GPU, as a Ray actor given one
    does, runs its rank there)."""
    device = load.torch_device()
    if device.type != "cuda" or rank == 0:
        return device
    return torch.device("cuda", ((device.index or 0) + rank) % torch.cuda.device_count())


def join_group(
    load: LoadConfig, parallel: ParallelConfig, rank: int, timeout_s: float
) -> ProcessGroupRanks:
    """Join the worker's group as ``rank`` (rank 0 hosts its store); every wait of this rank
    in it is bounded by ``timeout_s``."""
    if parallel.port == 0:
        raise ValueError("port must be chosen (not 0) before the ranks join their group")
    device = rank_device(load, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL runs on the process's current device
    return ProcessGroupRanks.join(
        parallel.resolved_backend(device),
        parallel.host,
        parallel.port,
        rank,
        parallel.tensor_parallel_size,
        timeout_s,
    )


def rank0_group(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    parallel: ParallelConfig,
    weights: LoadedWeights | None,
) -> TensorParallelGroup | None:
    """Rank 0's group (None: one rank): the one ``weights`` were kept with, its followers
    told to rebuild for these configs as rank 0 does (a worker changing role), else joined."""
    if weights is not None and weights.group is not None:
        if weights.group.size != parallel.tensor_parallel_size:
            raise ValueError(
                f"weights kept by a worker of {weights.group.size} ranks cannot build one "
                f"of tensor_parallel_size {parallel.tensor_parallel_size}"
            )
        rebuild = RebuildCommand(load, cache, scheduler, speculative, weights.kv_cache.held)
        send_command(weights.group, rebuild)
        return weights.group
    if parallel.tensor_parallel_size > 1:
        return join_group(load, parallel, 0, parallel.timeout_s)
    return None


def share_cpu_threads(size: int) -> int:
    """Give this process its 1/``size`` of the cores' torch threads (the ranks of a worker on
    CPU share one machine, and more threads than cores spin against each other: 2 ranks of 2
    threads each on 2 cores made a tiny model's step 6x slower than 1 thread each); returns
    the count it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    return before


def check_max_model_len(load: LoadConfig, model_config: ModelConfig) -> int:
    """The cap on a sequence's tokens; raises ValueError past the model's positions."""
    model_max = model_config.max_position_embeddings
    if load.max_model_len is not None and load.max_model_len > model_max:
        raise ValueError(
            f"max_model_len ({load.max_model_len}) must be <= the model's "
            f"max_position_embeddings ({model_max})"
        )
    return load.max_model_len or model_max


def build_rank_model(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    group: TensorParallelGroup | None,
    weights: LoadedWeights | None = None,
    parallel: ParallelConfig | None = None,
) -> RankModel:
    """This rank's model shard and KV cache shard (``group`` None: the one rank of a worker;
    ``parallel``: its ranks' config, whether they deal the routed experts out whole).
    ``weights``: a worker's one rank loaded already (``RankModel.loaded_weights`` of the engine
    it had before it changed role): kept, and the rest built anew for these configs (the
    shard is theirs)."""
    model_config = load_model_config(load.model_dir)
    size, rank = (1, 0) if group is None else (group.size, group.rank)
    expert_parallel = parallel is not None and parallel.expert_parallel
    if weights is not None:
        expert_parallel = weights.model.shard.expert_parallel
    shard = TensorParallelShard.of(model_config, rank, size, expert_parallel)
    device = rank_device(load, rank)
    num_threads_before = None if weights is None else weights.num_threads_before
    if device.type == "cpu" and size > 1 and weights is None:  # (kept: shared already)
        num_threads_before = share_cpu_threads(size)
    dtype = load.torch_dtype(model_config.checkpoint_dtype)
    max_model_len = check_max_model_len(load, model_config)
    torch.manual_seed(load.seed)
    linear_backend = resolve_linear_backend(load.linear_backend, device, dtype)
    if weights is not None:
        if weights.group is not group:
            raise ValueError("kept weights are rebuilt on the group they were kept with")
        weights.check_loaded_as(load, device, dtype, linear_backend)
        model = weights.model
        if device.type == "cuda":  # what is allocated below is sized to the memory free
            if cache.budget.num_blocks is None:  # (by the memory profile, without the cache)
                weights.kv_cache.release()
            _collect_engine_before(device)
    else:
        model = load_model(
            load.model_dir,
            model_config,
            dtype,
            device,
            load.load_format,
            load.seed,
            linear_backend,
            # size 1 takes the loader's unsharded path, exactly as before tensor parallelism
            shard=shard if size > 1 else None,
            group=group if size > 1 else None,
        )
    # speculative decoding's draft model, whole, on rank 0 alone (which schedules and samples;
    # the followers never see it); its cache once the blocks are counted
    draft = None
    if speculative is not None and speculative.method == "draft_model" and rank == 0:
        draft = load_draft_model(
            speculative, load, model_config, dtype, device, linear_backend, max_model_len,
            cache.block_size,
        )  # fmt: skip
    # speculative decoding's prediction layer, sharded as the model's layers: its KV cache is
    # one more slot of the model's, of the rank's heads (engine/config_checks.py checked it
    # can, before rank 0 started)
    predicts = speculative is not None and speculative.method == "mtp"
    predictor = None
    if predicts:
        predictor = load_prediction_layer(
            load.model_dir, dtype, device, load.load_format, load.seed, linear_backend,
            shard=shard if size > 1 else None, group=group if size > 1 else None,
        )  # fmt: skip
    cache_groups = model_config.cache_groups
    float_layout = KVLayout(
        num_layers=cache_groups.num_slots + predicts,
        num_kv_heads=shard.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=cache.block_size,
        dtype=dtype,
        kv_planes=model_config.kv_planes,
        num_cache_groups=cache_groups.num_groups,
    )
    # what the cache stores: the model's dtype, or 8-bit elements with their scales
    layout = dataclasses.replace(float_layout, dtype=storage_dtype(cache.kv_cache_dtype, dtype))
    # decode steps of these batch sizes (rows: a token each, drafts included) replay CUDA
    # graphs; eager ones are sized alike
    rows_per_seq = 1 if speculative is None else 1 + speculative.num_speculative_tokens
    padded_batch_sizes = capture_batch_sizes(
        max_decode_rows(
            min(load.max_capture_batch_size, scheduler.max_num_seqs),
            rows_per_seq,
            scheduler.max_num_batched_tokens,
        )
    )
    attn_backend = get_attention_backend(
        cache.attention_backend, device, DecodeSizing(max_model_len, padded_batch_sizes)
    )
    kv_cache_scales = None
    if cache.quantized_kv:
        kv_cache_scales = _kv_cache_scales(
            load,
            cache,
            model_config,
            model,
            float_layout,
            attn_backend,
            device,
            max_model_len,
            group,
            predictor,
        )
        set_kv_scales(model, kv_cache_scales, shard.kv_heads, device)
        if predictor is not None:  # its slot's scales: the last layer's
            set_kv_scales(predictor, kv_cache_scales, shard.kv_heads, device)
    graph_batch_sizes = None  # decode steps run eagerly
    # Under tensor parallelism every step runs eagerly: a graph replay would skip the step
    # mirror's broadcast of the inputs, and the followers would not run the same forward. So
    # do a mixture-of-experts model's: its experts run over host-side counts of their tokens;
    # and a latent-attention model's, whose attention has no graph-sized kernels yet.
    graphable = size == 1 and model_config.moe is None and model_config.mla is None
    if graphable and use_decode_graphs(load.enforce_eager, device, attn_backend.name):
        graph_batch_sizes = padded_batch_sizes
    # a step samples a row per sequence, and with drafts a row per draft besides
    max_num_sample_rows = scheduler.max_num_seqs
    if speculative is not None:
        max_num_sample_rows = min(
            scheduler.max_num_batched_tokens, scheduler.max_num_seqs * rows_per_seq
        )
    activation_bytes = 0
    if cache.budget.num_blocks is None and cache.budget.memory_bytes is None:
        activation_bytes = _activation_bytes(
            model,
            layout,
            attn_backend,
            device,
            scheduler,
            graph_batch_sizes,
            max_num_sample_rows,
            rows_per_seq,
            max_model_len,
            model_config.vocab_size,
        )
    draft_block_bytes = 0 if draft is None else draft.layout.bytes_per_block
    num_blocks = num_kv_blocks(cache.budget, layout, device, activation_bytes, draft_block_bytes)
    if group is not None:  # each rank measured its own memory; the cache is what all can hold
        # (rank 0's, with a draft model's cache beside its own, may hold fewer)
        num_blocks = group.min_int(num_blocks)
    # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache = None  # the engine before on these weights: its cache if it fits
    if weights is not None:
        kv_cache = weights.kv_cache.take_if(layout.shape(num_blocks), layout.dtype, device)
        if kv_cache is None and device.type != "cuda":  # (a GPU's was collected above)
            _collect_engine_before(device)  # its cache, not taken, freed first
    if kv_cache is None:
        kv_cache = torch.zeros(layout.shape(num_blocks), dtype=layout.dtype, device=device)
    host_kv_cache = None
    if cache.kv_offload_gb > 0:
        num_host_slots = num_host_kv_slots(cache.kv_offload_gb, layout)
        if group is not None:  # rank 0's tier decides for every rank's
            num_host_slots = group.min_int(num_host_slots)
        host_kv_cache = host_cache_like(kv_cache, num_host_slots)
    decode_graphs = None
    if graph_batch_sizes is not None:
        decode_graphs = DecodeGraphs(
            model,
            kv_cache,
            attn_backend,
            max_model_len=max_model_len,
            batch_sizes=graph_batch_sizes,
            capturer=CudaGraphCapturer(device),
            max_rows_per_seq=rows_per_seq,
            num_cache_groups=cache_groups.num_groups,
        )
    drafter: Drafter | None = None
    if predictor is not None and rank == 0:
        assert speculative is not None
        drafter = MtpDrafter(
            predictor, kv_cache, attn_backend, speculative, model_config.vocab_size,
            followers=group if size > 1 else None,
        )  # fmt: skip
    if draft is not None:
        assert speculative is not None
        vocab_size = model_config.vocab_size
        drafter = draft.drafter(
            num_blocks, attn_backend, speculative, vocab_size, device,
            scheduler.max_num_batched_tokens,
        )  # fmt: skip
    return RankModel(
        model_config=model_config,
        shard=shard,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        model=model,
        kv_cache=kv_cache,
        attn_backend=attn_backend,
        decode_graphs=decode_graphs,
        max_num_sample_rows=max_num_sample_rows,
        num_threads_before=num_threads_before,
        kv_cache_scales=kv_cache_scales,
        host_kv_cache=host_kv_cache,
        loaded_as=_loaded_as(load, device, dtype, linear_backend),
        drafter=drafter,
        predictor=predictor,
    )


def _kv_cache_scales(
    load: LoadConfig,
    cache: CacheConfig,
    model_config: ModelConfig,
    model: CausalLM,
    float_layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    max_model_len: int,
    group: TensorParallelGroup | None,
    predictor: MultiTokenPredictor | None,
) -> KVCacheScales:
    """A quantized cache's scales for the whole model (and its prediction layer's slot, the
    last, where ``predictor`` runs): the configuration's, else the checkpoint's
    (engine/quantization/kv_cache_scheme.py; not for a latent-attention model, which refuses
    them), else calibrated (engine/kv_calibration.py)."""
    num_layers = model_config.num_layers + (predictor is not None)
    if cache.kv_cache_scales is not None:
        cache.kv_cache_scales.check_model(
            num_layers,
            model_config.num_kv_heads,
            cache.kv_cache_dtype,
            model_config.kv_planes,
        )
        return cache.kv_cache_scales
    if load.load_format != "dummy":
        checkpoint = checkpoint_kv_scales(
            safetensors_files(Path(load.model_dir)),
            model_config.kv_cache_scheme,
            num_layers,
            model_config.num_kv_heads,
            cache.kv_cache_dtype,
        )
        if checkpoint is not None and model_config.mla is not None:
            # a latent cache has one scale per layer for its whole entries; which of the
            # checkpoint's K and V scales would stand for it is not settled
            raise ValueError(
                f"the checkpoint's KV cache scales (k_scale/v_scale) are not supported for a "
                f"latent-attention model ({model_config.architecture}); give kv_cache_scales, "
                f"or drop them to calibrate"
            )
        if checkpoint is not None:
            return checkpoint
    size = 1 if group is None else group.size
    token_ids = calibration_token_ids(
        load.tokenizer or load.model_dir,
        model_config.vocab_size,
        min(MAX_CALIBRATION_TOKENS, max_model_len - 1),
        load.trust_remote_code,
    )
    return calibrate_kv_scales(
        model,
        float_layout,
        model_config.cache_groups,
        attn_backend,
        device,
        token_ids,
        cache.kv_cache_dtype,
        kv_heads_of_ranks(model_config, size),
        group,
        predictor,
    )


def _activation_bytes(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    scheduler: SchedulerConfig,
    graph_batch_sizes: tuple[int, ...] | None,
    max_num_sample_rows: int,
    rows_per_seq: int,
    max_model_len: int,
    vocab_size: int,
) -> int:
    """What a worst-case step (and the decode graphs, when captured) holds beside the weights
    and the KV cache (0 off CUDA: not measurable there)."""
    activation_bytes = 0
    if graph_batch_sizes is not None:
        activation_bytes += decode_graph_bytes(
            model,
            layout,
            attn_backend,
            device,
            batch_sizes=graph_batch_sizes,
            max_model_len=max_model_len,
            max_rows_per_seq=rows_per_seq,
        )
    activation_bytes += peak_activation_bytes(
        model,
        layout,
        attn_backend,
        device,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_sample_rows=max_num_sample_rows,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )
    return activation_bytes
