"""The drafts a drafter made after a step (a draft model's, a prediction layer's), kept for the
scheduler to take the next step while the sequence's tokens are the ones they followed."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from engine.speculative.config import SpeculativeConfig


class DraftsKept:
    """What the scheduler asks of a drafter that drafts after each step (``DraftProposer``):
    ``_drafts`` is filled by the drafter."""

    def __init__(self, speculative: SpeculativeConfig) -> None:
        self.num_speculative_tokens = speculative.num_speculative_tokens
        self.disable_by_batch_size = speculative.disable_by_batch_size
        # seq_id -> (its token count when drafted, the drafts to follow those tokens)
        self._drafts: dict[int, tuple[int, tuple[int, ...]]] = {}

    def proposes_for(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` sequences running takes drafts at all."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def propose(
        self, token_ids: SequenceOf[int], max_num_drafts: int, seq_id: int | None = None
    ) -> tuple[int, ...]:
        """Up to ``max_num_drafts`` of the drafts made after ``seq_id``'s last step, if they
        follow ``token_ids``; () otherwise."""
        drafted = None if seq_id is None else self._drafts.get(seq_id)
        if drafted is None or drafted[0] != len(token_ids) or max_num_drafts < 1:
            return ()
        return drafted[1][:max_num_drafts]

    def forget(self, seq_id: int) -> None:
        self._drafts.pop(seq_id, None)
