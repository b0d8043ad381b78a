"""Speculative decoding in the planner's simulation (``pdserve plan --num-speculative-tokens K
--draft-acceptance R``): the workers' own scheduler asks a proposer for drafts, as the engine's
asks its prompt lookup (engine/speculative/), and each step's drafts stand or fall as a model's
check would let them.

A decoding sequence proposes K drafts a step (fewer where its budget or max_tokens leave less
room); the step computes them beside its token, each a decode row attending to the context
(as the workers report a speculating step, engine/step_timings.py), the sequence's KV read once
for all of them on the roofline (``StepShape.decode_kv_tokens``). The leading drafts stand, each
after the one before it with probability ``a``, until one falls; the sequence then takes those
and the token drawn after them. ``R`` is what pdserve reports of a served model: the share of
draft tokens that stood (``pdserve:spec_decode_num_accepted_tokens`` over
``..._num_draft_tokens``), that is, with K drafts, (a + a^2 + ... + a^K) / K; the simulation
solves ``a`` from it. A prompt-lookup proposer finds no n-gram in some of the times it is asked:
such a step computes the sequence's token alone. ``--draft-rate D`` is the share of the times it
found drafts (``pdserve:spec_decode_num_drafts`` over ``..._num_draft_attempts``); a simulated
sequence gets drafts in a step with probability D.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.scheduler.outputs import AcceptedDrafts, ScheduledSequence
from engine.speculative.config import MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True, slots=True)
class Speculation:
    num_tokens: int  # drafts a decoding sequence proposes a step, at most
    acceptance: float  # the share of draft tokens that stood, as pdserve reports it
    # no drafts in a step while more sequences than this are running (None: always)
    disable_by_batch_size: int | None = None
    draft_rate: float = 1.0  # the share of the times a sequence asks that it gets drafts

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_tokens}"
            )
        if not 0 <= self.acceptance <= 1:
            raise ValueError(f"--draft-acceptance must be in [0, 1], got {self.acceptance}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                "--speculative-disable-by-batch-size must be >= 1, got "
                f"{self.disable_by_batch_size}"
            )
        if not 0 <= self.draft_rate <= 1:
            raise ValueError(f"--draft-rate must be in [0, 1], got {self.draft_rate}")

    @property
    def stands_after_previous(self) -> float:
        """``a``: the probability a draft stands when the one before it did, such that of
        ``num_tokens`` drafts the share ``acceptance`` stands on average (bisection: the
        share grows with ``a``)."""
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            if _share_standing(middle, self.num_tokens) < self.acceptance:
                low = middle
            else:
                high = middle
        return (low + high) / 2


def _share_standing(a: float, k: int) -> float:
    """Of k drafts, each standing after the one before with probability a: the mean share
    that stands, (a + a^2 + ... + a^k) / k."""
    return sum(a**j for j in range(1, k + 1)) / k


class PlannedDrafts:
    """A proposer (engine/speculative/proposer.py) of ``num_tokens`` drafts of ``token``, found
    (seeded) at ``draft_rate`` of the times it is asked."""

    def __init__(self, speculation: Speculation, token: int, seed: int | str = 0) -> None:
        self.speculation = speculation
        self.token = token
        self.num_lookahead_slots = 0
        self._rng = random.Random(seed)

    def proposes_for(self, num_running: int) -> bool:
        limit = self.speculation.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(
        self, token_ids: Sequence[int], max_num_drafts: int, seq_id: int | None = None
    ) -> tuple[int, ...]:
        rate = self.speculation.draft_rate
        if rate < 1 and self._rng.random() >= rate:
            return ()
        return (self.token,) * min(max_num_drafts, self.speculation.num_tokens)


class DraftChecks:
    """How many of a step's drafts stand, drawn (seeded) as ``Speculation`` says."""

    def __init__(self, speculation: Speculation, seed: int = 0) -> None:
        self._stands = speculation.stands_after_previous
        self._rng = random.Random(seed)

    def check(self, scheduled: Iterable[ScheduledSequence]) -> dict[int, AcceptedDrafts]:
        """A step's checks, as the model runner reports them: by sequence id, the leading
        drafts that stood of each sequence that had drafts."""
        checked = {}
        for entry in scheduled:
            drafts = entry.draft_token_ids
            if drafts:
                standing = self.num_standing(len(drafts))
                checked[entry.seq.seq_id] = AcceptedDrafts(
                    list(drafts[:standing]), [None] * standing, len(drafts)
                )
        return checked

    def num_standing(self, num_drafts: int) -> int:
        standing = 0
        while standing < num_drafts and self._rng.random() < self._stands:
            standing += 1
        return standing
