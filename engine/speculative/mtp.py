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
Under tensor parallelism the layer is sharded as the model's layers are: rank 0 drafts, and
tells its followers each forward of the layer (and each logits of it) as it tells them the
model's (``PredictCommand``, ``PredictLogitsCommand``); they read the same rows of their own
hidden states, replicated as rank 0's.
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
from engine.parallel.group import TensorParallelGroup
from engine.parallel.step_commands import PredictCommand, PredictLogitsCommand, send_command
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput
from engine.scheduler.scheduler import speculates
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_batch import Chunk, chunk_forward, rows_with_padding
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
        # a tensor-parallel worker's ranks (None: one rank): each runs the layer's forwards
        followers: TensorParallelGroup | None = None,
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
        self.followers = followers
        self._output = torch.empty(0)  # the layer's last forward's, [rows, hidden_size]

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
            step_rows = np.asarray(rows, dtype=np.int64)
            if not drafting:
                self._forward(chunks, step.hidden, step_rows, True, [])
                return
            # the row of the layer's output after each drafting sequence's newest token so far
            last, tokens = self._forward(
                chunks, step.hidden, step_rows, True, [c for c, _, _ in drafting]
            )
            drafts = [[token] for token in tokens]
            for step_index in range(1, max(n for _, _, n in drafting)):
                going = [i for i, (_, _, n) in enumerate(drafting) if n > step_index]
                after = [
                    Chunk(seq, seq.num_tokens - 2 + step_index, [drafts[i][-1]])
                    for i in going
                    for seq in (drafting[i][1],)
                ]
                last[going], tokens = self._forward(
                    after, self._output, last[going], False, list(range(len(after)))
                )
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
        self,
        chunks: list[Chunk],
        source: torch.Tensor,  # the step's hidden states, or the layer's last output
        source_rows: np.ndarray,  # the row of ``source`` it reads at each chunk token, in order
        from_step: bool,  # ``source`` is the step's (else the layer's output)
        argmax_of: list[int],
    ) -> tuple[np.ndarray, list[int]]:
        """One forward of the layer over ``chunks``, kept as ``_output``; the rows of it at the
        last position of the chunks ``argmax_of`` names, and the argmax of its logits there.
        Under tensor parallelism the followers run each forward and logits with rank 0."""
        forward = chunk_forward(chunks, self.kv_cache, self.attn_backend, self.pads_rows)
        rows = source_rows[forward.source_rows]  # in the forward's order
        held = rows_with_padding(source, rows, forward.num_padding_rows)
        if self.followers is not None:
            command = PredictCommand(forward.inputs, rows, from_step)
            send_command(self.followers, command, forward.input_ids)
        with set_forward_context(forward.context):
            self._output = self.predictor(forward.input_ids, forward.positions, held)
        if not argmax_of:
            return rows[:0], []
        last = forward.last_rows(argmax_of)
        if self.followers is not None:
            send_command(self.followers, PredictLogitsCommand(last))
        outputs = self._output.index_select(0, to_device(last, None, self.device))
        logits = self.predictor.compute_logits(outputs)
        tokens = logits[:, : self.target_vocab_size].argmax(dim=-1).tolist()
        return last, [int(t) for t in tokens]
