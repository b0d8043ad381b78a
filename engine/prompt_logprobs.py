"""Prompt logprobs (vLLM's ``prompt_logprobs``): the logits of prompt positions, not only of the
last one, for the sequences that ask.

The logits at position i give the distribution of the token at i + 1, so a step that computes a
prompt chunk [start, end) gives the prompt logprobs of positions start + 1 .. end (the last
prompt position's logits are the sampling row instead). Chunks are adjacent, so chunk
boundaries need nothing special. A sequence records how many leading positions it already has
(``Sequence.num_prompt_logprob_positions``); a prompt recomputed after a preemption gives only
the others. Only the rows of sequences that owe them are turned into logits, ``max_rows_per_pass``
at a time, so a long chunk never holds [num_tokens, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling import PromptTokenLogprobs
from engine.sampling.logprobs import token_and_top_logprobs
from engine.scheduler.outputs import ScheduledSequence


@dataclass(frozen=True, slots=True)
class PromptLogprobsSpan:
    """The prompt positions of one sequence whose logprobs one step gives."""

    seq_id: int  # the sequence owing them
    first_position: int  # the first such prompt position (>= 1)
    hidden_rows: range  # rows of the step's hidden states whose logits give them, in order
    token_ids: list[int]  # the prompt tokens at those positions
    num_top: int  # params.prompt_logprobs: how many most likely tokens to give per position


def prompt_logprobs_spans(ordered: SequenceOf[ScheduledSequence]) -> list[PromptLogprobsSpan]:
    """The spans a step's entries give, in the order the forward lays their tokens out; empty
    when no sequence owes prompt logprobs (the runner then computes nothing more)."""
    spans: list[PromptLogprobsSpan] = []
    first_row = 0  # row of the entry's first token in the step's hidden states
    for entry in ordered:
        seq = entry.seq
        start = entry.start_position
        if seq.owes_prompt_logprobs:
            first = max(start + 1, seq.num_prompt_logprob_positions)
            end = min(start + entry.num_new_tokens + 1, seq.num_prompt_tokens)
            if first < end:
                num_top = seq.params.prompt_logprobs
                assert num_top is not None
                offset = first_row - start - 1  # the logits of position p - 1 give position p
                spans.append(
                    PromptLogprobsSpan(
                        seq_id=seq.seq_id,
                        first_position=first,
                        hidden_rows=range(offset + first, offset + end),
                        token_ids=seq.token_ids[first:end],
                        num_top=num_top,
                    )
                )
        first_row += entry.num_query_tokens
    return spans


def compute_prompt_logprobs(
    logits_at: Callable[[torch.Tensor, np.ndarray], torch.Tensor],
    hidden: torch.Tensor,  # [num_tokens, hidden_size] the step's hidden states
    spans: SequenceOf[PromptLogprobsSpan],
    max_rows_per_pass: int,
) -> dict[int, PromptTokenLogprobs]:
    """seq_id -> the prompt logprobs of its span, from raw fp32 logits of the span's rows;
    ``logits_at(hidden, rows)`` gives the logits of int64 ``rows`` (the runner's, one call a
    pass)."""
    device = hidden.device
    rows = np.fromiter((r for s in spans for r in s.hidden_rows), dtype=np.int64)
    targets = torch.tensor([t for s in spans for t in s.token_ids], dtype=torch.long, device=device)
    max_top = max(s.num_top for s in spans)
    pieces = []
    for begin in range(0, len(rows), max_rows_per_pass):
        end = begin + max_rows_per_pass
        logits = logits_at(hidden, rows[begin:end])  # [r, vocab]
        pieces.append(token_and_top_logprobs(logits, targets[begin:end], max_top))
    # one copy to the host for the step: [R], [R], [R, max_top], [R, max_top]
    logprobs, ranks, top_ids, top_logprobs = (
        torch.cat([piece[i] for piece in pieces]).tolist() for i in range(4)
    )
    result: dict[int, PromptTokenLogprobs] = {}
    begin = 0
    for span in spans:
        end, n = begin + len(span.token_ids), span.num_top
        result[span.seq_id] = PromptTokenLogprobs(
            first_position=span.first_position,
            token_ids=tuple(span.token_ids),
            logprobs=tuple(logprobs[begin:end]),
            ranks=tuple(ranks[begin:end]),
            top_token_ids=tuple(tuple(ids[:n]) for ids in top_ids[begin:end]),
            top_logprobs=tuple(tuple(lps[:n]) for lps in top_logprobs[begin:end]),
        )
        begin = end
    return result
