"""Continuous batching with chunked prefill, prefix caching and preemption.

Lifecycle of a sequence:
  waiting --(admitted: cached prefix attached, blocks allocated)--> running
  (a sequence whose KV was received from a prefill worker waits holding its blocks; only
   ``_reclaim_waiting_blocks`` takes them, when nothing else could give blocks back)
  running --(every step: its next chunk or its next token is scheduled)--> running
  running --(out of blocks: newest running sequence is preempted, its full blocks committed to
             the prefix cache, then freed)--> waiting (front)
  running --(stop token / max tokens / abort)--> finished (blocks freed)

A preempted sequence comes back through the prefix cache: its blocks still cached on the device,
or kept by the host-memory tier once evicted there (engine/kv_cache/host_tier.py), are taken
back; only the rest is recomputed. Each step's output carries the copies between the tiers its
building made owed (``BlockManager.take_swaps``), whether or not it schedules anything.

Each step, sequences already running are served first in arrival order (decodes and unfinished
prompt chunks alike), each taking what it needs from the step's token budget; waiting sequences
are admitted after them while budget, blocks and ``max_num_seqs`` allow.

Policies (vLLM's ``scheduling_policy``): "fcfs" keeps both queues in order of arrival (a
preempted sequence first in the waiting queue). "priority" keeps both in order of (priority,
arrival), lower first: the running are served, and waiting admitted, in that order, and the
last running (lowest priority, latest arrival) is the one preempted. A waiting sequence never
preempts a running one, whatever their priorities (as vLLM).

A step's tokens count as computed when it is scheduled (``num_computed_tokens``), and a
sequence whose next token the step samples holds a pending token until ``update`` applies the
step. With async scheduling the engine schedules the next step before then
(``schedule(step_in_flight=True)``), once the step in flight is launched and its blocks are in
the prefix cache (``commit_launched``): a sequence with a pending token decodes it, its id fed
from the device; one whose pending token may end its run here (hand-off, fork, length) waits a
step; and where blocks are short the schedule is empty rather than preempt anyone, so the
engine applies the step in flight and schedules again.

With a draft proposer (speculative decoding), a running sequence that decodes also asks it for
draft tokens, which take budget and slots like its own token (a sequence short of blocks drops
its drafts before anyone is preempted). ``update`` advances it past its token and the drafts
that stood; the slots of the drafts that fell are written over by the tokens that follow. A
proposer that drafts after the step on the blocks (a draft model) also has such a sequence given
``num_lookahead_slots`` slots past its step's tokens, up to its last token (no budget: nothing
of the step's runs there); they go before its drafts when blocks are short.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Literal, get_args

from engine.kv_cache.block_manager import BlockManager
from engine.sampling.seeds import derive_seed
from engine.scheduler.outputs import (
    AppendedTokens,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from engine.scheduler.stop import finish_reason_after_append
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.speculative.proposer import DraftProposer

# (sequence, its drafts) -> the leading drafts it may take
DraftFilter = Callable[[Sequence, tuple[int, ...]], tuple[int, ...]]
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 2048  # tokens per step (prompt chunks + decodes)
    enable_chunked_prefill: bool = True  # split prompts longer than the step budget
    policy: SchedulingPolicy = "fcfs"  # "priority": by (request priority, arrival)
    # schedule and launch each step before the step before it has given its tokens (vLLM's
    # async scheduling): the host's work overlaps the GPU's; not with speculative decoding
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: Collection[int],
        proposer: DraftProposer | None = None,
        draft_filter: DraftFilter | None = None,
    ) -> None:
        """``draft_filter``: the leading drafts a sequence may take (its structured output's
        grammar allows them); None: all the proposer gives."""
        self.config = config
        self.proposer = proposer  # None: no speculative decoding
        self.draft_filter = draft_filter
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; the last one is preempted first
        self.num_preemptions = 0
        # speculative decoding: the times a decoding sequence asked the proposer for drafts
        # (whether it found any)
        self.num_draft_attempts = 0
        self._seq_ids = itertools.count()

    # ---- queue management -------------------------------------------------------------
    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self._enqueue(seq)

    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError when ``seq`` could never run here: more samples than
        ``max_num_seqs``, or more KV than the whole cache holds (where layers have a sliding
        window and prefill is chunked, those layers hold their window and a step's tokens)."""
        if seq.params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n ({seq.params.n}) must be <= max_num_seqs ({self.config.max_num_seqs})"
            )
        manager = self.block_manager
        # it gives back what falls out of a window: it holds the window and a step's tokens
        chunked = self.config.enable_chunked_prefill and not seq.prefill_only
        step_tokens = self.config.max_num_batched_tokens if chunked else None
        needed = manager.max_blocks_held(seq.max_total_tokens, step_tokens)
        if needed > manager.pool.num_blocks:
            raise ValueError(
                f"request needs up to {seq.max_total_tokens} tokens of KV cache ({needed} "
                f"blocks), more than the {manager.pool.num_blocks} blocks of "
                f"{manager.block_size} tokens the cache holds; lower max_tokens or the prompt "
                "length"
            )

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` with reason "abort"; returns them."""
        aborted = [
            s for s in itertools.chain(self.waiting, self.running) if s.request_id == request_id
        ]
        for seq in aborted:
            self._finish(seq, "abort")
        return aborted

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens not computed yet: the waiting sequences', and the rest of the running
        ones' prompts being prefilled in chunks (a decoding sequence's one token is no prompt)."""
        return sum(s.num_uncomputed_tokens for s in self.waiting) + sum(
            s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1
        )

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, *, step_in_flight: bool = False) -> SchedulerOutput:
        """The next step. ``step_in_flight``: the step scheduled last is not applied yet (async
        scheduling; see the module's docstring)."""
        if step_in_flight and not self._fits_ahead():
            return self._output([], [], 0, 0)
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        num_preempted = 0
        index = 0
        drafting = (
            not step_in_flight
            and self.proposer is not None
            and self.proposer.proposes_for(len(self.running))
        )
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if step_in_flight and not runs_ahead(seq):
                index += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            drafts = self._drafts(seq, budget) if drafting else ()
            lookahead = self._lookahead(seq, num_new + len(drafts)) if drafting else 0
            self.block_manager.release_outside_window(seq)
            while not self.block_manager.can_allocate(seq, num_new + len(drafts) + lookahead):
                if lookahead:  # the first thing to go: the room to draft after the step
                    lookahead = 0
                    continue
                if drafts:  # then the drafts
                    drafts = ()
                    continue
                # the only one running: before it preempts itself, the queue's blocks
                if len(self.running) == 1 and self._reclaim_waiting_blocks(seq, num_new):
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                copies += self.block_manager.allocate_slots(seq, num_new + len(drafts) + lookahead)
                scheduled.append(self._entry(seq, num_new, drafts))
                budget -= num_new + len(drafts)
                index += 1
        if num_preempted == 0:
            budget = self._admit_waiting(budget, scheduled, copies)
        num_batched = self.config.max_num_batched_tokens - budget
        return self._output(scheduled, copies, num_batched, num_preempted)

    def _output(
        self,
        scheduled: list[ScheduledSequence],
        copies: list[tuple[int, int]],
        num_batched_tokens: int,
        num_preempted: int,
    ) -> SchedulerOutput:
        """The step, with every copy between the cache's tiers its building made owed."""
        swap_outs, swap_ins = self.block_manager.take_swaps()
        return SchedulerOutput(
            scheduled=scheduled,
            block_copies=copies,
            num_batched_tokens=num_batched_tokens,
            num_preempted=num_preempted,
            swap_outs=swap_outs,
            swap_ins=swap_ins,
        )

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[AppendedTokens]:
        """Apply a step's results; returns the sequences that received tokens, and how many."""
        updated: list[AppendedTokens] = []
        for entry in output.scheduled:
            seq = entry.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            if entry.draft_token_ids:
                updated.append(self._take_checked_drafts(entry, result))
                continue
            computed = entry.start_position + entry.num_new_tokens  # KV up to this step's
            if seq.owes_prompt_logprobs:  # the runner gave those of this chunk's positions
                seq.num_prompt_logprob_positions = max(
                    seq.num_prompt_logprob_positions, min(computed + 1, seq.num_prompt_tokens)
                )
            self.block_manager.commit_computed(seq, computed)
            if entry.sample_seqs:
                seq.num_pending_tokens -= 1
            # every child shares the prompt's blocks before any sample, the first included, can
            # finish on its first token and free them
            for target in entry.sample_seqs:
                if target is not seq:
                    self.block_manager.fork(seq, target)
                    target.status = SequenceStatus.RUNNING
                    self._add_running(target)
                    seq.is_forked = target.is_forked = True
            for target in entry.sample_seqs:
                target.token_ids.append(result.sampled_token_ids[target.seq_id])
                updated.append(AppendedTokens(target, 1))
                reason = finish_reason_after_append(target, self.eos_token_ids)
                if reason is not None:
                    self._finish(target, reason)
                elif target.prefill_only:
                    self._hand_off(target)
        return updated

    def commit_launched(self, output: SchedulerOutput) -> None:
        """A scheduled step is launched: the blocks it fills enter the prefix cache now, not at
        its update, so a prompt admitted by a schedule ahead of that update (async scheduling)
        finds them. Only after the launch: a step that never ran must leave no cached block."""
        for entry in output.scheduled:
            if not entry.seq.is_finished:
                computed = entry.start_position + entry.num_new_tokens
                self.block_manager.commit_computed(entry.seq, computed)

    def _take_checked_drafts(
        self, entry: ScheduledSequence, result: ModelRunnerOutput
    ) -> AppendedTokens:
        """A speculating sequence takes the drafts that stood, then the token drawn after them,
        stopping early at a token that finishes it."""
        seq = entry.seq
        accepted = result.accepted_drafts[seq.seq_id].token_ids
        reason: FinishReason | None = None
        num_appended = 0
        for token in [*accepted, result.sampled_token_ids[seq.seq_id]]:
            seq.token_ids.append(token)
            num_appended += 1
            reason = finish_reason_after_append(seq, self.eos_token_ids)
            if reason is not None:
                break
        # the step computed its token and the drafts that stood: the KV of all but the newest
        seq.num_pending_tokens -= 1
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.commit_computed(seq)
        if reason is not None:
            self._finish(seq, reason)
        return AppendedTokens(seq, num_appended)

    def add_computed(self, seq: Sequence) -> None:
        """Queue a sequence whose KV (all but its last token) already sits in its blocks."""
        assert seq.num_computed_tokens == seq.num_tokens - 1 and seq.block_tables
        self.check_fits(seq)
        seq.is_forked = True
        self._enqueue(seq)

    def release(self, seq: Sequence) -> None:
        """End a handed-off sequence's lease: its blocks are freed (full ones stay cached)."""
        if seq.status is SequenceStatus.HANDED_OFF:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED

    # ---- helpers ------------------------------------------------------------------------
    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledSequence], copies: list[tuple[int, int]]
    ) -> int:
        """Admit queued sequences, head first, while budget, blocks and ``max_num_seqs`` allow.

        A head that does not fit gives back the cached prefix it attached here (its blocks stay
        cached) but keeps the KV it was queued with (received from a prefill worker: freed, its
        partial last block would be recomputed). It waits while running sequences finish or are
        preempted, which queue ahead of it without blocks. Its blocks cannot hang the engine:
        the only running sequence, before it preempts itself, and a head that finds nothing
        running take them (``_reclaim_waiting_blocks``).
        """
        if not self.waiting:
            return budget
        # running sequences once those of n > 1 still prefilling have forked
        num_seqs = sum(_num_seqs_to_come(seq) for seq in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if num_seqs + _num_seqs_to_come(seq) > self.config.max_num_seqs:
                break
            holds_received_kv = bool(seq.block_tables)
            # a sequence owing prompt logprobs computes its prompt (it still fills the cache)
            if not holds_received_kv and not seq.owes_prompt_logprobs:
                num_cached = self.block_manager.attach_cached_prefix(seq)
                if seq.num_preemptions == 0:  # back from a preemption, it hits its own blocks
                    seq.num_cached_prompt_tokens = num_cached
            self.block_manager.release_outside_window(seq)  # of a prefix hit or received KV
            num_new = min(seq.num_uncomputed_tokens, budget)
            chunk_refused = (
                num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill
            )
            fits = not chunk_refused and self.block_manager.can_allocate(seq, num_new)
            if not fits and not chunk_refused and not self.running:
                fits = self._reclaim_waiting_blocks(seq, num_new)
            if not fits:
                if not holds_received_kv:
                    self.block_manager.free(seq)
                break
            self.waiting.popleft()
            self.block_manager.count_lookup(seq)
            copies += self.block_manager.allocate_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self._add_running(seq)
            num_seqs += _num_seqs_to_come(seq)
            scheduled.append(self._entry(seq, num_new))
            budget -= num_new
        return budget

    def _reclaim_waiting_blocks(self, seq: Sequence, num_new: int) -> bool:
        """Free the blocks that queued sequences hold (KV received from a prefill worker),
        newest first, until ``seq`` has room for ``num_new`` tokens; returns whether it has.

        Those blocks come free only once their sequences run, and they queue behind ``seq``.
        Kept, they hung the engine: every step ran nothing, or ``seq`` filled the other blocks
        chunk by chunk, preempted itself and started again, for ever. So when nothing else
        could give blocks back (``seq`` is the only one running, or none is), they are taken.
        A sequence that loses its blocks here counts as preempted: its KV is recomputed when
        it is admitted.
        """
        for queued in reversed(self.waiting):
            if self.block_manager.can_allocate(seq, num_new):
                break
            if queued is not seq and queued.block_tables:
                self._drop_kv(queued)
        return self.block_manager.can_allocate(seq, num_new)

    def _fits_ahead(self) -> bool:
        """Whether the running sequences a schedule ahead of the step in flight would take
        have blocks for their tokens (ahead of it, nobody is preempted)."""
        budget = self.config.max_num_batched_tokens
        manager = self.block_manager
        # at most: the budget's tokens in new blocks, plus a block each for a sequence's
        # partly filled one and a copy-on-write (a roomy cache skips the count)
        if manager.num_free_blocks >= -(-budget // manager.block_size) + 2 * len(self.running):
            return True
        needed = 0
        for seq in self.running:
            if budget <= 0:
                break
            if runs_ahead(seq):
                num_new = min(seq.num_uncomputed_tokens, budget)
                needed += manager.num_blocks_needed(seq, num_new)
                budget -= num_new
        return needed <= manager.num_free_blocks

    def _drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Draft tokens for a running sequence to compute after its next token this step: ()
        unless it decodes, speculates, and has room (budget, max tokens) for one at least."""
        if self.proposer is None or not _decodes_speculating(seq):
            return ()
        # a sequence ends at max_total_tokens; the token drawn after the drafts needs a place
        room = min(budget - 1, seq.max_total_tokens - seq.num_tokens - 1)
        if room < 1:
            return ()
        self.num_draft_attempts += 1
        drafts = self.proposer.propose(seq.token_ids, room, seq.seq_id)
        if drafts and self.draft_filter is not None:
            drafts = self.draft_filter(seq, drafts)
        return drafts

    def _lookahead(self, seq: Sequence, num_step_tokens: int) -> int:
        """Slots past a decoding sequence's ``num_step_tokens`` for a proposer that drafts after
        the step on the blocks (a draft model): its number, up to the sequence's last token."""
        assert self.proposer is not None
        if self.proposer.num_lookahead_slots == 0 or not _decodes_speculating(seq):
            return 0
        room = seq.max_total_tokens - seq.num_computed_tokens - num_step_tokens
        return max(0, min(self.proposer.num_lookahead_slots, room))

    def _entry(
        self, seq: Sequence, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        """The sequence's entry in the step; its tokens count as computed from now on."""
        start = seq.num_computed_tokens
        reaches_end = start + num_new == seq.num_tokens + seq.num_pending_tokens
        sample_seqs: tuple[Sequence, ...] = ()
        if reaches_end:
            sample_seqs = (seq,) if seq.is_forked else (seq, *self._make_children(seq))
        entry = ScheduledSequence(
            seq=seq,
            start_position=start,
            num_new_tokens=num_new,
            sample_seqs=sample_seqs,
            draft_token_ids=drafts,
            awaits_sampled_token=seq.num_pending_tokens > 0,
        )
        seq.num_computed_tokens += num_new
        if reaches_end:
            seq.num_pending_tokens += 1
        return entry

    def _make_children(self, parent: Sequence) -> Iterable[Sequence]:
        for index in range(1, parent.params.n):
            seed = None if parent.seed is None else derive_seed(parent.seed, index)
            yield Sequence(
                self.new_seq_id(),
                parent.request_id,
                parent.token_ids,
                parent.params,
                parent.max_total_tokens,
                sample_index=index,
                priority=parent.priority,
                arrival=parent.arrival,
                seed=seed,
                cache_salt=parent.cache_salt,
                prefill_only=parent.prefill_only,
            )

    def _hand_off(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.HANDED_OFF

    def _preempt(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        seq.status = SequenceStatus.WAITING
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=_queue_key)
        else:
            self.waiting.appendleft(seq)

    def _enqueue(self, seq: Sequence) -> None:
        if self.config.policy == "priority":  # after those of its priority that came before
            bisect.insort(self.waiting, seq, key=_queue_key)
        else:
            self.waiting.append(seq)

    def _add_running(self, seq: Sequence) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.running, seq, key=_queue_key)
        else:
            self.running.append(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Free the sequence's blocks; a preemption. Its full computed blocks (prompt and
        generated tokens alike) are committed first, so they stay cached: when it runs again it
        takes them back from the device cache or, once evicted there, from the host tier, and
        recomputes only what neither holds."""
        self.block_manager.commit_computed(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.block_tables:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def runs_ahead(seq: Sequence) -> bool:
    """Whether a running sequence may be scheduled before the step in flight is applied: yes
    unless that step samples its next token and the token may end its run here (a prefill-only
    sequence hands off on it, an n > 1 request forks on it, a sequence one token short of its
    limit finishes on it). One that samples a stop token computes a token that is thrown away.
    """
    if not seq.num_pending_tokens:
        return True
    return (
        seq.is_forked
        and not seq.prefill_only
        and seq.num_tokens + seq.num_pending_tokens < seq.max_total_tokens
    )


def speculates(seq: Sequence) -> bool:
    """Whether the sequence may take drafts: not seeded sampling (its stream is one draw per
    token, replayed when a request resumes elsewhere)."""
    return seq.seed is None or seq.params.greedy


def _decodes_speculating(seq: Sequence) -> bool:
    """Whether the sequence decodes this step (its one token; its samples forked) and may
    take drafts."""
    return (
        seq.num_uncomputed_tokens == 1
        and seq.is_forked
        and not seq.prefill_only
        and speculates(seq)
    )


def _queue_key(seq: Sequence) -> tuple[int, int]:
    """The order of the "priority" policy: lower priority value first, then earlier arrival."""
    return seq.priority, seq.arrival


def _num_seqs_to_come(seq: Sequence) -> int:
    """How many sequences ``seq`` will be: n while a request of n > 1 has not forked yet."""
    return 1 if seq.is_forked else seq.params.n
