"""Checking a step's draft tokens against the target model's logits.

Each row is the distribution of one position of a speculating sequence: the row after its
last known token checks the first draft, the next row the second draft (given the first), and
so on; the row after the last draft has no draft and gives the token that follows when every
draft stands. A draft stands when:
- greedy rows: it is the argmax of the processed logits (so the output is the one greedy
  decoding without drafts gives);
- sampled rows: a uniform draw falls below the target's probability of it (the rejection rule
  for a draft proposed with certainty, as prompt lookup proposes). A row whose draft falls
  draws its token from the target's distribution with the draft removed, so every token
  emitted is distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023).
The processing (mask, bias, bans, penalties, temperature, top-k/p, min-p) is the sampler's
own, row by row, so each row's history must already hold the drafts before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.logprobs import compute_logprobs
from engine.sampling.messages import SamplingRow, TokenLogprobs
from engine.sampling.processors import sampling_probs
from engine.sampling.rng import sample_from_probs
from engine.sampling.sampler import Sampler

NO_DRAFT = -1  # the draft id of a row that checks none


@dataclass(frozen=True, slots=True)
class CheckedRows:
    """Per row of a ``check_drafts`` call."""

    accepted: list[bool]  # its draft stands (always False for a row with no draft)
    token_ids: list[int]  # its draft where accepted, else the token drawn in its place
    logprobs: list[TokenLogprobs | None]  # of token_ids[row], raw; None unless asked


def check_drafts(
    logits: torch.Tensor, rows: Sequence[SamplingRow], draft_token_ids: Sequence[int]
) -> CheckedRows:
    """``logits`` [R, V] raw, one row per position; ``draft_token_ids`` [R] the draft each row
    checks, ``NO_DRAFT`` for none. Sampled rows draw from the global RNG: seeded rows do not
    speculate (their stream is one [V] draw per token, which a resumed request replays)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows) or len(rows) != len(draft_token_ids):
        raise ValueError(
            f"logits must be [num_rows={len(rows)}, vocab_size] with a draft id per row, got "
            f"{tuple(logits.shape)} and {len(draft_token_ids)} draft ids"
        )
    device = logits.device
    logits = logits.float()  # [R, V]
    processed = Sampler.processed_logits(logits, rows)  # [R, V]
    drafts = torch.tensor([max(d, 0) for d in draft_token_ids], dtype=torch.long, device=device)
    has_draft = torch.tensor([d != NO_DRAFT for d in draft_token_ids], device=device)
    tokens = processed.argmax(dim=-1)  # [R] greedy rows' choice
    accepted = (tokens == drafts) & has_draft  # [R]
    sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled_rows:
        if any(rows[i].generator is not None for i in sampled_rows):
            raise ValueError("seeded sampled rows cannot check drafts")
        sel = torch.tensor(sampled_rows, dtype=torch.long, device=device)
        probs = sampling_probs(
            processed.index_select(0, sel), [rows[i].params for i in sampled_rows]
        )
        row_drafts = drafts.index_select(0, sel).unsqueeze(1)  # [b, 1]
        row_has_draft = has_draft.index_select(0, sel)  # [b]
        draft_probs = probs.gather(1, row_drafts)[:, 0]  # [b]
        uniform = torch.rand(len(sampled_rows), device=device)
        accepted[sel] = (uniform < draft_probs) & row_has_draft
        # the target's distribution without the draft (rows with no draft keep it whole)
        kept = torch.where(row_has_draft, torch.zeros_like(draft_probs), draft_probs)
        residual = probs.scatter(1, row_drafts, kept.unsqueeze(1))  # [b, V]
        tokens[sel] = sample_from_probs(residual, [None] * len(sampled_rows))
    chosen = torch.where(accepted, drafts, tokens)  # [R]
    return CheckedRows(
        accepted=accepted.tolist(),
        token_ids=chosen.tolist(),
        logprobs=compute_logprobs(logits, rows, chosen),
    )
