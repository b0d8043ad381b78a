"""A follower rank of a tensor-parallel worker: runs the model calls rank 0 makes, in order.

Lifecycle of a follower process (``run_follower``, started by engine/parallel/ranks.py): join
the worker's group -> build its model shard and KV cache shard (and host tier buffer) from the
same configs as rank 0 (engine/parallel/rank_model.py) -> ``Follower.run``: each command rank 0
broadcasts (block swaps with the host tier; block copies; a forward; logits of rows of that
forward's hidden states; a forward of the model's prediction layer and its logits) is run as
rank 0 runs it, until the stop command -> leave the group.
It never schedules or samples: its logits are computed only because the model's gather of them
is a collective.

The follower waits for rank 0's next step without a practical bound (a worker may sit idle);
it stops when rank 0's process is gone (a thread watches it) or when the group fails (a peer
gone: a collective raises).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.forward_context import ForwardContext, set_forward_context
from engine.kv_cache.host_copies import HostCopier
from engine.model_runner import copy_blocks
from engine.models.registry import CausalLM
from engine.parallel.group import TensorParallelGroup
from engine.parallel.rank_model import RankModel, build_rank_model, join_group
from engine.parallel.step_commands import (
    CopyBlocksCommand,
    ForwardCommand,
    LogitsCommand,
    PredictCommand,
    PredictLogitsCommand,
    RebuildCommand,
    StopCommand,
    SwapBlocksCommand,
    receive_command,
)
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_batch import rows_with_padding

# a follower's bound on each wait: rank 0 may be idle for as long as its user likes
FOLLOWER_WAIT_S = 7 * 24 * 3600.0
EXIT_PARENT_GONE = 3  # the exit code of a follower whose rank 0 process went away


class Follower:
    """Runs rank 0's model calls on this rank's shard."""

    def __init__(
        self,
        group: TensorParallelGroup,
        built: RankModel,  # what this rank computes with (build_rank_model's)
        on_rebuilt: Callable[[RankModel], None] | None = None,  # after each rebuild
    ) -> None:
        self.group = group
        self.on_rebuilt = on_rebuilt
        self.num_forwards = 0
        self.num_logits = 0
        self.num_predictions = 0  # the prediction layer's forwards
        self._use(built)

    def _use(self, built: RankModel) -> None:
        self.built = built
        self.model: CausalLM = built.model
        # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = built.kv_cache
        self.attn_backend: AttentionBackend = built.attn_backend
        self.device = built.device
        # this rank's host tier, [num_host_slots, num_slots, kv_planes, block_size,
        # num_kv_heads, head_dim] (none: the worker has none)
        host = built.host_kv_cache
        self.host_copier = None if host is None else HostCopier(built.kv_cache, host)

    def run(self) -> None:
        """Run commands until rank 0's stop command."""
        hidden: torch.Tensor | None = None  # [num_tokens, hidden] of the last forward
        predicted: torch.Tensor | None = None  # [rows, hidden] of the prediction layer's last
        with torch.inference_mode():
            while True:
                command, input_ids = receive_command(self.group, self.device)
                if isinstance(command, StopCommand):
                    return
                if isinstance(command, SwapBlocksCommand):
                    if self.host_copier is None:
                        raise RuntimeError(
                            "rank 0 sent block swaps, but this rank has no host tier"
                        )
                    self.host_copier.swap(command.swap_outs, command.swap_ins)
                elif isinstance(command, CopyBlocksCommand):
                    copy_blocks(self.kv_cache, command.copies)
                elif isinstance(command, ForwardCommand):
                    assert input_ids is not None
                    hidden = self._forward(command, input_ids)
                    self.num_forwards += 1
                elif isinstance(command, LogitsCommand):
                    if hidden is None:
                        raise RuntimeError("rank 0 asked for logits before any forward")
                    rows = torch.from_numpy(command.rows).to(self.device)
                    self.model.compute_logits(hidden.index_select(0, rows))
                    self.num_logits += 1
                elif isinstance(command, PredictCommand):
                    assert input_ids is not None
                    source = hidden if command.from_step else predicted
                    if source is None:
                        raise RuntimeError("rank 0 asked for a prediction before its inputs")
                    predicted = self._predict(command, input_ids, source)
                    self.num_predictions += 1
                elif isinstance(command, PredictLogitsCommand):
                    if predicted is None or self.built.predictor is None:
                        raise RuntimeError("rank 0 asked for a prediction's logits before one")
                    rows = torch.from_numpy(command.rows).to(self.device)
                    self.built.predictor.compute_logits(predicted.index_select(0, rows))
                elif isinstance(command, RebuildCommand):
                    hidden = predicted = None
                    self._rebuild(command)

    def _rebuild(self, command: RebuildCommand) -> None:
        """Build this rank for the worker's new role on the weights it holds (rank 0 builds
        its own at the same time: engine/llm_engine.py)."""
        kept = self.built.loaded_weights(command.keep_kv_cache, self.group)
        del self.built, self.model, self.kv_cache, self.attn_backend, self.host_copier
        with torch.inference_mode(False):  # (built as its first build was: outside the loop's)
            built = build_rank_model(
                command.load, command.cache, command.scheduler, command.speculative, self.group,
                kept,
            )  # fmt: skip
        self._use(built)
        if self.on_rebuilt is not None:
            self.on_rebuilt(built)

    def _forward(self, command: ForwardCommand, input_ids: torch.Tensor) -> torch.Tensor:
        positions, metadata = command.inputs.on_device(self.device)
        context = ForwardContext.for_groups(metadata, self.kv_cache, self.attn_backend)
        with set_forward_context(context):
            return self.model.forward(input_ids, positions)

    def _predict(
        self, command: PredictCommand, input_ids: torch.Tensor, source: torch.Tensor
    ) -> torch.Tensor:
        predictor = self.built.predictor
        if predictor is None:
            raise RuntimeError("rank 0 asked for a prediction, but this rank has no such layer")
        positions, metadata = command.inputs.on_device(self.device)
        held = rows_with_padding(source, command.rows, command.inputs.num_padding_rows)
        context = ForwardContext.for_groups(metadata, self.kv_cache, self.attn_backend)
        with set_forward_context(context):
            return predictor(input_ids, positions, held)


def run_follower(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    parallel: ParallelConfig,
    rank: int,
) -> None:
    """A follower process's whole life (the target of its ``multiprocessing.Process``)."""
    _exit_with_parent()
    follower, _ = build_follower(load, cache, scheduler, speculative, parallel, rank)
    try:
        follower.run()
    finally:
        follower.group.close()


def build_follower(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    parallel: ParallelConfig,
    rank: int,
) -> tuple[Follower, RankModel]:
    """Join the worker's group as ``rank`` and build its shard: the follower, ready to run,
    and what it holds (its KV cache and heads, which a rank actor's KV port reads). The caller
    runs the follower and closes its group."""
    group = join_group(load, parallel, rank, FOLLOWER_WAIT_S)
    try:
        built = build_rank_model(load, cache, scheduler, speculative, group, parallel=parallel)
    except BaseException:
        group.close()
        raise
    follower = Follower(group, built)
    return follower, built


def _exit_with_parent() -> None:
    """Ends this process when the process that started it (rank 0) ends, whatever this one
    is waiting in: no follower outlives its worker."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="rank-0-watch", daemon=True).start()
