"""One sequence of tokens being generated: the unit the scheduler and block manager track.

A request with n > 1 parallel samples starts as one sequence; when its prompt is done it forks
into n sequences that share the prompt's KV blocks (copy-on-write).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Literal

from engine.kv_cache.block_table import BlockTable

if TYPE_CHECKING:
    from engine.kv_cache.prefix_hash import BlockHash
    from engine.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation of its tokens
    RUNNING = "running"  # holds KV blocks, scheduled every step
    HANDED_OFF = "handed_off"  # prefill-only: first token sampled, KV kept under a lease
    FINISHED = "finished"  # done; blocks released


class Sequence:
    __slots__ = (
        "seq_id",
        "request_id",
        "sample_index",
        "params",
        "seed",
        "cache_salt",
        "token_ids",
        "num_prompt_tokens",
        "max_total_tokens",
        "num_computed_tokens",
        "num_pending_tokens",
        "block_tables",
        "block_hashes",
        "num_committed_blocks",
        "num_released_blocks",
        "status",
        "finish_reason",
        "num_cached_prompt_tokens",
        "num_preemptions",
        "is_forked",
        "prefill_only",
        "num_prompt_logprob_positions",
        "priority",
        "arrival",
        "prefix_lookup",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        *,
        sample_index: int = 0,
        seed: int | None = None,
        cache_salt: str | None = None,
        prefill_only: bool = False,
        prompt_logprobs: bool = False,
        priority: int = 0,
        arrival: int | None = None,
    ) -> None:
        self.seq_id = seq_id  # unique per engine
        self.request_id = request_id
        self.sample_index = sample_index  # which of the request's n samples this is
        self.params = params
        self.seed = seed  # this sample's own seed (derived from params.seed for n > 1)
        self.cache_salt = cache_salt  # tenant salt mixed into prefix hashes
        self.token_ids = list(prompt_token_ids)  # prompt then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_total_tokens = max_total_tokens  # prompt + max output, capped by max_model_len
        # tokens whose KV is in the cache, or is computed by a step already scheduled (the
        # scheduler counts a step's tokens when it schedules them)
        self.num_computed_tokens = 0
        # tokens that scheduled steps are to sample, not in token_ids until their results are
        # applied: 1 from a step's scheduling to its update; with async scheduling the next
        # step is scheduled before then (and computes that token's KV, fed from the device)
        self.num_pending_tokens = 0
        # physical block per logical block, a table per KV cache group (engine/kv_cache/
        # cache_groups.py), all of one length; empty while the sequence holds no blocks
        self.block_tables: list[BlockTable] = []
        self.block_hashes: list[BlockHash] = []  # prefix hash per full block of token_ids
        # leading logical blocks offered to the prefix cache (in every group's table)
        self.num_committed_blocks = 0
        # per group, leading blocks of its table given back, outside its sliding window
        # (BlockManager); 0 for a group that sees the whole context
        self.num_released_blocks: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.is_forked = params.n == 1  # n > 1: becomes True once the n samples exist
        self.prefill_only = prefill_only  # stop after the first token and keep the KV (P/D split)
        # Leading prompt positions whose prompt logprobs exist (position 0 has none to give):
        # the runner computes the rest as the prompt's chunks run, once, even across a
        # recompute. All of them for a sequence that owes none (it was not asked, or is an
        # n > 1 child, a resumed or a received sequence: the request's first one gives them).
        self.num_prompt_logprob_positions = 1 if prompt_logprobs else self.num_prompt_tokens
        # the scheduling policy "priority" serves lower values first, then earlier arrivals:
        # its request's order of arrival at this engine (the first sequence's id by default;
        # a request's other samples share it)
        self.priority = priority
        self.arrival = seq_id if arrival is None else arrival
        # the last prefix lookup's (blocks looked up, blocks found), counted once the sequence
        # is admitted with it (BlockManager.count_lookup)
        self.prefix_lookup: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to compute: the prompt's KV must be computed here, not
        taken from the prefix cache (cached positions have no logits)."""
        return self.num_prompt_logprob_positions < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.value})"
        )
