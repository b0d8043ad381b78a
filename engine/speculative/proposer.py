"""What the scheduler asks a draft proposer (engine/scheduler/scheduler.py): whether a step of
so many running sequences takes drafts, the drafts to follow a sequence's tokens, and the slots
a decoding sequence needs past its step's tokens for the proposer to draft after the step. The
engine's are prompt lookup (``ngram.NgramProposer``), a draft model
(``draft_model.DraftModel``) and a prediction layer (``mtp.MtpDrafter``), the last two drafting
after each step into those slots; ``pdserve plan``
simulates one that drafts at a given acceptance (router/planner/speculation.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.scheduler.outputs import SchedulerOutput
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from engine.model_runner import LaunchedStep


class DraftProposer(Protocol):
    # slots a decoding sequence is given beyond its step's tokens, where the proposer writes
    # its own KV while drafting after the step (0: it computes nothing on the blocks)
    num_lookahead_slots: int

    def proposes_for(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` sequences running takes drafts at all."""
        ...

    def propose(
        self, token_ids: Sequence[int], max_num_drafts: int, seq_id: int | None = None
    ) -> tuple[int, ...]:
        """Up to ``max_num_drafts`` draft tokens to follow ``token_ids`` (of ``seq_id``)."""
        ...


class Drafter(DraftProposer, Protocol):
    """A proposer that computes its drafts after each step (a draft model, a prediction
    layer), on the model runner's device."""

    def draft_after(self, output: SchedulerOutput, step: LaunchedStep) -> None:
        """Draft for the next step, once ``output``'s tokens (``step`` computed them) are in
        its sequences."""
        ...

    def forget(self, seq_id: int) -> None:
        """Drop what it keeps of a finished sequence."""
        ...


def proposer_for(
    speculative: SpeculativeConfig | None, drafter: DraftProposer | None, max_num_seqs: int
) -> DraftProposer | None:
    """The engine's proposer: the draft model's (``drafter``, built with the model), else
    prompt lookup's when speculative decoding is on (keeping ``max_num_seqs`` contexts)."""
    if drafter is not None or speculative is None:
        return drafter
    return NgramProposer(speculative, max_contexts=max_num_seqs)
