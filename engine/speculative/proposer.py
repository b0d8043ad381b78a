"""What the scheduler asks a draft proposer (engine/scheduler/scheduler.py): whether a step of
so many running sequences takes drafts, and the drafts to follow a sequence's tokens. The
engine's is prompt lookup (``ngram.NgramProposer``); ``pdserve plan`` simulates one that drafts
at a given acceptance (router/planner/speculation.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftProposer(Protocol):
    def proposes_for(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` sequences running takes drafts at all."""
        ...

    def propose(
        self, token_ids: Sequence[int], max_num_drafts: int, seq_id: int | None = None
    ) -> tuple[int, ...]:
        """Up to ``max_num_drafts`` draft tokens to follow ``token_ids`` (of ``seq_id``)."""
        ...
