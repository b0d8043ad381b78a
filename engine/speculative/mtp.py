"""Speculative decoding with the model's own multi-token-prediction layer (vLLM's ``"method":
"mtp"``; DeepSeek-V3, GLM-4.5): the layer (engine/models/prediction_layer.py) reads the target's
final hidden states and proposes each decoding sequence's next tokens, greedily, after every
step; the target checks them the step after, as it checks a draft model's (a draft proposed
with certainty: greedy output is unchanged, sampled output keeps the target's distribution).

The layer's KV at position p is computed from the target's hidden state at p and the token at
p + 1, so it can only be computed in the step that computed p, once p + 1's token is known.
After each step, for every sequence the step computed (prompt chunks of prefill-only and
decode workers alike, decodes, drafts being checked):
1. catches up: one batched forward of the layer over the step's positions whose next token is
   known now (a prompt chunk's all, the last one's with the token sampled after it; of a step
   that checked drafts, the positions up to the last draft that stood), from the step's hidden
   states, written into the cache slot after the decoder's (so the blocks carry it: the prefix
   cache, the host tier and a hand-off between workers move it with the target's KV);
2. drafts, for a decoding sequence: the argmax after its newest token's position - 1 is the
   first draft; each further draft is one more batched forward, the draft before it at the
   next position with the layer's own output standing in for the target's hidden state, its
   KV written into the slots the scheduler gives the sequence past its step
   (``num_lookahead_slots``: one fewer than the drafts), rewritten by the next catch-up.
What it does not know, it does not recompute: positions a prefix-cache hit brought keep the KV
the layer wrote when their block was first computed; the position before a hit's first
computed token and a fork's last prompt position hold another sequence's (the token after them
differs), so drafts that attend to them may stand less often; the output is the target's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.forward_context import set_forward_context
from engine.host_to_device import to_device
from engine.kernels.linear import has_packed_linears
from engine.models.prediction_layer import MultiTokenPredictor
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput
from engine.scheduler.scheduler import speculates
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_batch import Chunk, chunk_forward
from engine.speculative.drafts_kept import DraftsKept

if TYPE_CHECKING:
    from engine.model_runner import LaunchedStep

_COMPUTED = (SequenceStatus.RUNNING, SequenceStatus.HANDED_OFF)  # blocks still held


class MtpDrafter(DraftsKept):
    """The proposer of draft tokens computed by a multi-token-prediction layer (see the
    module's docstring)."""

    def __init__(
        self,
        predictor: MultiTokenPredictor,
        # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]: the target's,
        # its last slot the prediction layer's
        kv_cache: torch.Tensor,
        attn_backend: AttentionBackend,
        speculative: SpeculativeConfig,
        target_vocab_size: int,  # drafts are ids the target has
    ) -> None:
        super().__init__(speculative)
        self.predictor = predictor
        self.kv_cache = kv_cache
        self.block_size = int(kv_cache.shape[3])
        self.attn_backend = attn_backend
        # the first draft writes nothing; each further one its KV at the position after the one
        # before (the newest token's position first)
        self.num_lookahead_slots = speculative.num_speculative_tokens - 1
        self.target_vocab_size = target_vocab_size
        self.device = kv_cache.device
        self.pads_rows = has_packed_linears(predictor)

    def draft_after(self, output: SchedulerOutput, step: LaunchedStep) -> None:
        """Catch up on ``step`` (the forward of ``output``) and draft for its decoding
        sequences (call once the step's tokens are in the sequences)."""
        chunks: list[Chunk] = []
        rows: list[int] = []  # the step's hidden row of each chunk's each position
        drafting: list[tuple[int, Sequence, int]] = []  # (chunk, sequence, drafts to make)
        drafts_wanted = self.proposes_for(len(output.scheduled))
        first_row = 0
        for entry in step.ordered:
            seq, start = entry.seq, entry.start_position
            self._drafts.pop(seq.seq_id, None)
            # the positions whose next token is known now
            num_known = min(entry.num_query_tokens, seq.num_tokens - 1 - start)
            if seq.status in _COMPUTED and num_known > 0:
                num_drafts = self._num_drafts(entry) if drafts_wanted else 0
                if num_drafts > 0:
                    drafting.append((len(chunks), seq, num_drafts))
                next_ids = seq.token_ids[start + 1 : start + 1 + num_known]
                chunks.append(Chunk(seq, start, next_ids))
                rows.extend(range(first_row, first_row + num_known))
            first_row += entry.num_query_tokens
        if not chunks:
            return
        with torch.inference_mode():
            hidden_rows = to_device(np.asarray(rows, dtype=np.int64), None, self.device)
            hidden = step.hidden.index_select(0, hidden_rows)
            if not drafting:
                self._forward(chunks, hidden, [])
                return
            # the layer's output after each drafting sequence's newest token so far
            outputs, tokens = self._forward(chunks, hidden, [c for c, _, _ in drafting])
            drafts = [[token] for token in tokens]
            for step_index in range(1, max(n for _, _, n in drafting)):
                going = [i for i, (_, _, n) in enumerate(drafting) if n > step_index]
                after = [
                    Chunk(seq, seq.num_tokens - 2 + step_index, [drafts[i][-1]])
                    for i in going
                    for seq in (drafting[i][1],)
                ]
                stepped, tokens = self._forward(after, outputs[going], list(range(len(after))))
                outputs[going] = stepped
                for i, token in zip(going, tokens):
                    drafts[i].append(token)
        for (_, seq, _), made in zip(drafting, drafts):
            self._drafts[seq.seq_id] = (seq.num_tokens, tuple(made))

    def _num_drafts(self, entry: ScheduledSequence) -> int:
        """The drafts to make for ``entry``'s sequence: none unless it decodes on and got a
        token of its own; at most as many as the blocks it holds have slots for."""
        seq = entry.seq
        if (
            entry.sample_seqs != (seq,)
            or seq.status is not SequenceStatus.RUNNING
            or seq.prefill_only
            or not speculates(seq)
        ):
            return 0
        newest = seq.num_tokens - 1  # its position
        last_slot = len(seq.block_tables[0]) * self.block_size - 1
        return min(
            self.num_speculative_tokens,
            last_slot - newest + 2,  # draft j writes its KV at newest + j - 2
            seq.max_total_tokens - seq.num_tokens - 1,  # the target's token after them
        )

    def _forward(
        self, chunks: list[Chunk], hidden: torch.Tensor, argmax_of: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """One forward of the layer over ``chunks`` (``hidden``: the state it reads at each of
        their positions, in order); its output at the last position of the chunks
        ``argmax_of`` names, and the argmax of its logits there."""
        forward = chunk_forward(chunks, self.kv_cache, self.attn_backend, self.pads_rows)
        held = hidden.index_select(0, forward.source_rows)
        if forward.num_padding_rows:
            held = torch.cat([held, held.new_zeros(forward.num_padding_rows, held.shape[1])])
        with set_forward_context(forward.context):
            out = self.predictor(forward.input_ids, forward.positions, held)
        if not argmax_of:
            return out[:0], []
        outputs = out.index_select(0, forward.last_rows(argmax_of))
        logits = self.predictor.compute_logits(outputs)
        tokens = logits[:, : self.target_vocab_size].argmax(dim=-1).tolist()
        return outputs, [int(t) for t in tokens]
