"""Messages between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling import PromptTokenLogprobs, TokenLogprobs
    from engine.sequence import Sequence


# the input id of an awaited token until the runner writes the sampled one over it
AWAITED_TOKEN_PLACEHOLDER = 0


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence  # the sequence whose tokens are computed this step
    start_position: int  # first new token's position (seq.num_computed_tokens when scheduled)
    num_new_tokens: int  # tokens computed this step: token_ids[start : start + num_new_tokens]
    # Sequences that receive a token sampled from this entry's last logits: () for a prompt
    # chunk that does not reach the end; (seq,) normally; (seq, *children) when an n > 1
    # request forks into its samples.
    sample_seqs: tuple[Sequence, ...]
    # Speculative decoding: tokens proposed to follow the sequence's last token, computed
    # after it this step and checked against the model's own choices (engine/speculative/).
    # Only a decoding sequence (num_new_tokens == 1, sample_seqs == (seq,)) has any.
    draft_token_ids: tuple[int, ...] = ()
    # Async scheduling: the entry's one new token is the one the step in flight samples for
    # the sequence, not in token_ids yet; the runner feeds it from that step's sampled tokens
    # on the device (the query token id below is a placeholder)
    awaits_sampled_token: bool = False

    @property
    def num_query_tokens(self) -> int:
        """Tokens the forward runs for this entry: the new ones, then the drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    def query_token_ids(self) -> list[int]:
        if self.awaits_sampled_token:
            return [AWAITED_TOKEN_PLACEHOLDER]
        start = self.start_position
        return self.seq.token_ids[start : start + self.num_new_tokens] + list(self.draft_token_ids)

    @property
    def newest_token_id(self) -> int:
        """The token a decoding entry (one new token) feeds; the placeholder if awaited."""
        if self.awaits_sampled_token:
            return AWAITED_TOKEN_PLACEHOLDER
        return self.seq.token_ids[self.start_position]


@dataclass(frozen=True, slots=True)
class AppendedTokens:
    seq: Sequence  # a sequence that received tokens in a step
    num_tokens: int  # how many: its last num_tokens token ids (more than 1 only with drafts)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step. The runner moves its blocks first, in this order: swap-outs, swap-ins,
    copy-on-write copies; then it runs the forward. A step that schedules nothing may still
    move blocks (a sequence that did not fit gave back blocks it had brought from the host)."""

    scheduled: list[ScheduledSequence]  # in scheduling order
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write block copies, before forward
    num_batched_tokens: int  # sum of num_query_tokens (drafts included)
    num_preempted: int  # sequences preempted while building this step
    # host-memory tier (engine/kv_cache/host_tier.py): (device block, host slot) of each cached
    # block evicted while building this step, whose content goes to the host before anything
    # of the step writes the block
    swap_outs: tuple[tuple[int, int], ...] = ()
    # (host slot, device block) of each block a prefix hit brings back from the host, copied
    # in after the swap-outs and before the forward
    swap_ins: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (blocks to move or not)."""
        return not self.scheduled

    @property
    def moves_blocks(self) -> bool:
        """Blocks to swap with the host tier or to copy, before anything else of the step."""
        return bool(self.swap_outs or self.swap_ins or self.block_copies)


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
