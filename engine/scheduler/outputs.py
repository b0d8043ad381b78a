"""Messages between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling import PromptTokenLogprobs, TokenLogprobs
    from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence  # the sequence whose tokens are computed this step
    start_position: int  # first new token's position (== seq.num_computed_tokens before update)
    num_new_tokens: int  # tokens computed this step: token_ids[start : start + num_new_tokens]
    # Sequences that receive a token sampled from this entry's last logits: () for a prompt
    # chunk that does not reach the end; (seq,) normally; (seq, *children) when an n > 1
    # request forks into its samples.
    sample_seqs: tuple[Sequence, ...]
    # Speculative decoding: tokens proposed to follow the sequence's last token, computed
    # after it this step and checked against the model's own choices (engine/speculative/).
    # Only a decoding sequence (num_new_tokens == 1, sample_seqs == (seq,)) has any.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_query_tokens(self) -> int:
        """Tokens the forward runs for this entry: the new ones, then the drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    def query_token_ids(self) -> list[int]:
        start = self.start_position
        return self.seq.token_ids[start : start + self.num_new_tokens] + list(self.draft_token_ids)


@dataclass(frozen=True, slots=True)
class AppendedTokens:
    seq: Sequence  # a sequence that received tokens in a step
    num_tokens: int  # how many: its last num_tokens token ids (more than 1 only with drafts)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # in scheduling order
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write block copies, before forward
    num_batched_tokens: int  # sum of num_query_tokens (drafts included)
    num_preempted: int  # sequences preempted while building this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[int, int]  # seq_id -> token sampled this step
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq_id -> its logprobs
    forward_seconds: float = 0.0  # wall time of the model forward + logits (for overhead stats)
    # seq_id -> prompt logprobs of the positions this step's chunk gave, for sequences owing them
    prompt_logprobs: dict[int, PromptTokenLogprobs] = field(default_factory=dict)
    # seq_id -> the leading drafts that stood, for sequences that had drafts; the sequence
    # takes them, then its token in sampled_token_ids (drawn where the next draft fell)
    accepted_drafts: dict[int, AcceptedDrafts] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AcceptedDrafts:
    token_ids: list[int]  # the drafts that stood, in order (possibly none)
    logprobs: list[TokenLogprobs | None]  # each one's raw logprobs (None entries unless asked)
    num_drafts: int  # drafts the sequence had this step
