"""Speculative decoding with a draft model (vLLM's ``"method": "draft_model"``): a smaller
model of the target's vocabulary proposes each decoding sequence's next tokens, greedily, after
every step; the target checks them the step after (engine/speculative/rejection.py takes each
as a draft proposed with certainty, so greedy output is unchanged and sampled output keeps the
target's distribution).

The draft model's KV cache has as many blocks as the target's and is indexed by the target's
block tables, so the scheduler's allocation serves both. Under tensor parallelism rank 0 alone
holds the draft model, whole, and its cache: the drafts are its scheduler's. After a step the drafter, for each
sequence the step gave a token of its own (a decode, or a prompt's last chunk; not a fork):
1. catches its cache up: one batched forward of every such sequence's tokens from the first
   position whose draft KV it trusts no more, up to its newest token. It trusts only what it
   wrote itself into the blocks the sequence holds now: a sequence new to it (a prompt, one
   handed off from a prefill worker) or whose blocks were given back since (preempted) starts
   from position 0, its prefix-cache hits included;
2. drafts: the argmax after the newest token is the first draft; each further draft is one
   more batched forward of the draft before it, at the next position, written into the slots
   the scheduler gave the sequence past its step (``num_lookahead_slots``). A sequence drafts
   as many as those slots and its max tokens allow.
The next schedule takes a sequence's drafts while its tokens are the ones they followed. The
draft KV written while drafting is kept where the drafts stood: the next catch-up starts after
them (usually one token: the target's own after the drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from engine.attention.backend import AttentionBackend
from engine.engine_config import LoadConfig
from engine.forward_context import set_forward_context
from engine.host_to_device import to_device
from engine.kernels.linear import has_packed_linears
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.budget import KVLayout
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from engine.models.registry import CausalLM
from engine.parallel.shard import TensorParallelShard
from engine.scheduler.outputs import SchedulerOutput
from engine.scheduler.scheduler import speculates
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_batch import Chunk, chunk_forward
from engine.speculative.draft_checks import check_draft_model
from engine.speculative.drafts_kept import DraftsKept

if TYPE_CHECKING:
    from engine.model_runner import LaunchedStep


@dataclass(frozen=True, slots=True)
class LoadedDraft:
    """A draft model loaded beside its target, before the cache's blocks are counted."""

    model: CausalLM
    layout: KVLayout  # of its KV cache: the target's blocks, its own layers and heads

    def drafter(
        self,
        num_blocks: int,
        attn_backend: AttentionBackend,
        speculative: SpeculativeConfig,
        target_vocab_size: int,
        device: torch.device,
        max_forward_tokens: int,
    ) -> DraftModel:
        """The proposer, its KV cache allocated on ``device``: ``num_blocks`` of ``layout``."""
        shape, dtype = self.layout.shape(num_blocks), self.layout.dtype
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        return DraftModel(
            self.model, kv_cache, attn_backend, speculative, target_vocab_size, max_forward_tokens
        )


def load_draft_model(
    speculative: SpeculativeConfig,
    load: LoadConfig,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    linear_backend: Literal["torch", "onednn"],
    max_model_len: int,
    block_size: int,
) -> LoadedDraft:
    """``speculative.model`` loaded as the target was (dtype, device, load format, linear
    backend); raises ValueError naming the field it cannot draft with."""
    config = check_draft_model(speculative, target, max_model_len)
    assert speculative.model is not None
    model = load_model(
        speculative.model,
        config,
        dtype,
        device,
        load.load_format,
        load.seed,
        linear_backend,
    )
    shard = TensorParallelShard.of(config, 0, 1)
    layout = KVLayout(
        num_layers=config.cache_groups.num_slots,
        num_kv_heads=shard.num_kv_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_planes=config.kv_planes,
    )
    return LoadedDraft(model, layout)


class DraftModel(DraftsKept):
    """The proposer of draft tokens computed by a draft model (see the module's docstring)."""

    def __init__(
        self,
        model: CausalLM,
        # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]: the draft
        # model's layers, the target's blocks
        kv_cache: torch.Tensor,
        attn_backend: AttentionBackend,
        speculative: SpeculativeConfig,
        target_vocab_size: int,  # drafts are ids the target has
        # tokens a draft forward runs at most (the target's step budget, which the memory
        # profile sized activations for): a longer catch-up runs in several
        max_forward_tokens: int,
    ) -> None:
        super().__init__(speculative)
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = int(kv_cache.shape[3])
        self.attn_backend = attn_backend
        self.num_lookahead_slots = speculative.num_speculative_tokens
        self.target_vocab_size = target_vocab_size
        self.max_forward_tokens = max_forward_tokens
        self.pads_rows = has_packed_linears(model)  # packed linears: rows padded to buckets
        # seq_id -> the block table its draft KV was written in, and how many leading
        # positions of it hold the KV of its tokens
        self._trusted: dict[int, tuple[BlockTable, int]] = {}
        self.num_forwards = 0  # draft forwards run (catch-ups and drafting steps)

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self._trusted.pop(seq_id, None)

    def draft_after(self, output: SchedulerOutput, step: LaunchedStep | None = None) -> None:
        """Catch up and draft for the step's sequences that received a token of their own
        (call once the step's tokens are in the sequences; ``step``, its forward, is not read:
        the draft model computes from the tokens alone)."""
        if not self.proposes_for(len(output.scheduled)):  # (disable_by_batch_size)
            return  # their drafts, if any, follow fewer tokens: none is taken
        seqs = [e.seq for e in output.scheduled if e.sample_seqs == (e.seq,)]
        plans: list[tuple[Sequence, int]] = []  # (sequence, drafts to make)
        chunks: list[Chunk] = []
        for seq in seqs:
            drafted = self._drafts.pop(seq.seq_id, None)
            if seq.status is not SequenceStatus.RUNNING or seq.prefill_only or not speculates(seq):
                continue
            table = seq.block_tables[0]
            newest = seq.num_tokens - 1  # its position
            num_drafts = min(
                self.num_speculative_tokens,
                len(table) * self.block_size - newest,  # slots for the newest and each draft
                seq.max_total_tokens - seq.num_tokens - 1,  # the target's token after them
            )
            if num_drafts < 1:
                continue
            trusted = self._trusted.get(seq.seq_id)
            start = trusted[1] if trusted is not None and trusted[0] is table else 0
            if drafted is not None and drafted[0] == start:
                start += _num_fed_and_stood(seq.token_ids, *drafted)
            start = min(start, newest)
            plans.append((seq, num_drafts))
            chunks.append(Chunk(seq, start, seq.token_ids[start : newest + 1]))
        if not chunks:
            return
        with torch.inference_mode():
            drafts = [[token] for token in self._catch_up(chunks)]
            for step_index in range(1, max(n for _, n in plans)):
                going = [i for i, (_, n) in enumerate(plans) if n > step_index]
                after = [
                    Chunk(plans[i][0], plans[i][0].num_tokens - 1 + step_index, [drafts[i][-1]])
                    for i in going
                ]
                for i, token in zip(going, self._forward_argmax(after)):
                    drafts[i].append(token)
        for (seq, _), made in zip(plans, drafts):
            self._drafts[seq.seq_id] = (seq.num_tokens, tuple(made))
            self._trusted[seq.seq_id] = (seq.block_tables[0], seq.num_tokens)

    def _catch_up(self, chunks: list[Chunk]) -> list[int]:
        """The draft model's argmax after each chunk, its tokens run in forwards of at most
        ``max_forward_tokens``: a chunk's leading pieces alone, then the last pieces batched."""
        limit = self.max_forward_tokens
        last_pieces: list[Chunk] = []
        for chunk in chunks:
            start, token_ids = chunk.start, chunk.token_ids
            while len(token_ids) > limit:
                self._forward_argmax([Chunk(chunk.seq, start, token_ids[:limit])])
                start, token_ids = start + limit, token_ids[limit:]
            last_pieces.append(Chunk(chunk.seq, start, token_ids))
        tokens: list[int] = []
        batch: list[Chunk] = []
        num_batched = 0
        for piece in last_pieces:
            if batch and num_batched + len(piece.token_ids) > limit:
                tokens += self._forward_argmax(batch)
                batch, num_batched = [], 0
            batch.append(piece)
            num_batched += len(piece.token_ids)
        return tokens + self._forward_argmax(batch)

    def _forward_argmax(self, chunks: list[Chunk]) -> list[int]:
        """One draft forward of ``chunks`` (their K/V written to the draft cache); the draft
        model's argmax after each chunk's last token, in ``chunks``' order."""
        forward = chunk_forward(chunks, self.kv_cache, self.attn_backend, self.pads_rows)
        with set_forward_context(forward.context):
            hidden = self.model.forward(forward.input_ids, forward.positions)
        rows = to_device(forward.last_rows(range(len(chunks))), None, self.kv_cache.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        self.num_forwards += 1
        return [int(t) for t in logits[:, : self.target_vocab_size].argmax(dim=-1).tolist()]


def _num_fed_and_stood(token_ids: list[int], num_tokens: int, drafts: tuple[int, ...]) -> int:
    """How many of the positions after a sequence's first ``num_tokens`` tokens hold draft KV
    of its tokens now: drafting fed every draft but the last, each at its position, so those
    of the leading drafts that stood."""
    num = 0
    while num < len(drafts) - 1 and num_tokens + num < len(token_ids):
        if token_ids[num_tokens + num] != drafts[num]:
            break
        num += 1
    return num
