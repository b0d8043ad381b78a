"""What rank 0 of a tensor-parallel worker tells its followers each step, and how it crosses.

Each model call of rank 0's runner is a collective (the model all-reduces and all-gathers
inside), so every follower runs the same call on the same rows, in the same order:
  SwapBlocksCommand  copies between the KV cache and its host-memory tier, first of a step that
                  has any (swap-outs, then swap-ins; engine/kv_cache/host_copies.py)
  CopyBlocksCommand  copy-on-write copies of KV blocks, before the forward of a step that has any
  ForwardCommand  one forward of the step's batch; its input ids follow as a tensor broadcast
                  (async scheduling writes awaited tokens into them on the device, after the
                  command is built)
  LogitsCommand   logits of rows of the last forward's hidden states (sampling rows, a pass
                  of prompt logprobs, drafts to check); one per ``compute_logits`` call
  PredictCommand  one forward of the model's prediction layer (speculative decoding's "mtp",
                  engine/speculative/mtp.py) over rows of the last forward's hidden states or
                  of the layer's own last output; its input ids follow as a forward's do
  PredictLogitsCommand  the prediction layer's logits of rows of its last output
  StopCommand     the worker is closing: the follower leaves its loop
  RebuildCommand  the worker changes role in its processes (router/worker_host.py): each rank
                  builds its attention backend and cache for the new role's configs on the
                  weights (and, where it fits, the KV cache) it holds, as rank 0 does
A command crosses as one pickled object from rank 0 (``TensorParallelGroup.broadcast_object``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.engine_config import CacheConfig, LoadConfig
from engine.host_to_device import to_device
from engine.parallel.group import TensorParallelGroup
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """One forward's batch on the host, beside its input ids: every rank builds its device
    tensors and attention metadata from it alike."""

    positions: np.ndarray  # [num_tokens] int64: each token's position in its sequence
    # [num_cache_groups, num_tokens] int64: block_id * block_size + offset of its K/V, in
    # each KV cache group's blocks
    slot_mapping: np.ndarray
    num_prefill_seqs: int  # entries of more than one token, first in the batch
    num_prefill_tokens: int  # their tokens: the first rows
    num_decode_seqs: int  # entries of one token: the last rows
    prefill_query_start_loc: list[int]  # [num_prefill_seqs + 1] row offsets of each prefill
    prefill_seq_lens: list[int]  # [num_prefill_seqs] context length after this step
    # [num_cache_groups, num_prefill_seqs, max_blocks] int64, padded with 0
    prefill_block_tables: np.ndarray
    decode_seq_lens: np.ndarray  # [num_decode_seqs] int64 context length incl. the new token
    # [num_cache_groups, num_decode_seqs, max_blocks] int64, padded with 0
    decode_block_tables: np.ndarray
    max_decode_seq_len: int  # max of decode_seq_lens (0 without decodes)
    # rows after the tokens that the forward runs and attention skips (position 0, no K/V
    # written): the step's rows padded to ``engine.kernels.linear.padded_rows``
    num_padding_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_rows(self) -> int:
        """The forward's rows: its tokens, then its padding."""
        return self.num_tokens + self.num_padding_rows

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, tuple[AttentionMetadata, ...]]:
        """The positions ([num_rows] int64, 0 for padding) and the attention metadata of each
        KV cache group on ``device``."""
        slot_mapping = to_device(self.slot_mapping, None, device)
        prefill_block_tables = to_device(self.prefill_block_tables, None, device)
        decode_block_tables = to_device(self.decode_block_tables, None, device)
        decode_seq_lens = to_device(self.decode_seq_lens, None, device)
        metadata = tuple(
            AttentionMetadata(
                num_prefill_seqs=self.num_prefill_seqs,
                num_prefill_tokens=self.num_prefill_tokens,
                num_decode_seqs=self.num_decode_seqs,
                slot_mapping=slot_mapping[group],
                prefill_query_start_loc=self.prefill_query_start_loc,
                prefill_seq_lens=self.prefill_seq_lens,
                prefill_block_tables=prefill_block_tables[group],
                decode_seq_lens=decode_seq_lens,
                decode_block_tables=decode_block_tables[group],
                max_decode_seq_len=self.max_decode_seq_len,
            )
            for group in range(len(self.slot_mapping))
        )
        positions = self.positions
        if self.num_padding_rows:
            positions = np.pad(positions, (0, self.num_padding_rows))
        return to_device(positions, None, device), metadata


@dataclass(frozen=True, slots=True)
class SwapBlocksCommand:
    """Move KV blocks between the cache and the host tier (this rank's heads of each)."""

    swap_outs: tuple[tuple[int, int], ...]  # (device block, host slot), copied first
    swap_ins: tuple[tuple[int, int], ...]  # (host slot, device block), copied after them


@dataclass(frozen=True, slots=True)
class CopyBlocksCommand:
    """Copy KV blocks (every layer's K and V) before the next forward."""

    copies: tuple[tuple[int, int], ...]  # (src, dst) block ids


@dataclass(frozen=True, slots=True)
class ForwardCommand:
    """Run one forward; the input ids follow as an int64 tensor of ``inputs.num_rows``."""

    inputs: ForwardInputs  # the batch the forward runs


@dataclass(frozen=True, slots=True)
class LogitsCommand:
    """Compute logits of these rows of the last forward's hidden states."""

    rows: np.ndarray  # [num_rows] int64 row indices, in the order rank 0 takes them


@dataclass(frozen=True, slots=True)
class PredictCommand:
    """Run one forward of the prediction layer; its input ids (the token after each position)
    follow as an int64 tensor of ``inputs.num_rows``. The hidden state it reads at each token
    row: ``rows`` of the model's last forward's hidden states (``from_step``) or of the layer's
    own last output; zeros at the padding rows."""

    inputs: ForwardInputs
    rows: np.ndarray  # [inputs.num_tokens] int64
    from_step: bool


@dataclass(frozen=True, slots=True)
class PredictLogitsCommand:
    """Compute the prediction layer's logits of these rows of its last output."""

    rows: np.ndarray  # [num_rows] int64


@dataclass(frozen=True, slots=True)
class StopCommand:
    """The worker is closing: the follower leaves its loop and its group."""


@dataclass(frozen=True, slots=True)
class RebuildCommand:
    """Build this rank anew for the worker's new role, on the weights it holds (the same
    configs rank 0 builds with: the collectives in the build line up)."""

    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None
    keep_kv_cache: bool  # the new build may take the rank's KV cache where it has its shape


StepCommand = (
    SwapBlocksCommand
    | CopyBlocksCommand
    | ForwardCommand
    | LogitsCommand
    | PredictCommand
    | PredictLogitsCommand
    | StopCommand
    | RebuildCommand
)


def send_command(
    group: TensorParallelGroup, command: StepCommand, input_ids: torch.Tensor | None = None
) -> None:
    """Rank 0: broadcast ``command`` (and a forward's ``input_ids``, [num_rows] int64 on the
    group's device)."""
    group.broadcast_object(command)
    if isinstance(command, (ForwardCommand, PredictCommand)):
        if input_ids is None or input_ids.shape != (command.inputs.num_rows,):
            raise ValueError(f"a forward of {command.inputs.num_rows} rows needs as many input ids")
        group.broadcast(input_ids)


def receive_command(
    group: TensorParallelGroup, device: torch.device
) -> tuple[StepCommand, torch.Tensor | None]:
    """A follower: rank 0's next command, with a forward's input ids on ``device``."""
    command = group.broadcast_object(None)
    if not isinstance(command, StepCommand):
        raise TypeError(f"rank 0 sent {type(command).__name__}, not a step command")
    if not isinstance(command, (ForwardCommand, PredictCommand)):
        return command, None
    input_ids = torch.empty(command.inputs.num_rows, dtype=torch.long, device=device)
    return command, group.broadcast(input_ids)
