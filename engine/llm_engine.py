"""The engine of one worker: requests in, a step at a time, outputs out.

A request's life: add_request (validated, queued as one sequence) -> step() after step() (the
scheduler picks tokens, the runner computes and samples, the scheduler applies the results)
-> a finished RequestOutput (or abort_request at any point).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import torch

from engine.config_checks import check_configs
from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.kv_events import KVEventRecorder
from engine.kv_cache.prefix_hash import BlockHash, num_servable_blocks
from engine.messages import PrefillResult, SampleStart, TokenEvent, WorkerCounters
from engine.messages.kv_events import KVBlocksEvent
from engine.model_config import ModelConfig
from engine.model_runner import LaunchedStep, ModelRunner
from engine.models.expert_tokens import ExpertTokenCounts
from engine.outputs import RequestOutput
from engine.parallel.group import TensorParallelGroup
from engine.parallel.rank_model import LoadedWeights, build_rank_model, rank0_group
from engine.request_state import RequestState
from engine.sampling import SamplingParams, TokenLogprobs
from engine.sampling.seeds import derive_seed
from engine.scheduler import (
    ModelRunnerOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)
from engine.sequence import SequenceStatus
from engine.speculative.config import SpeculativeConfig
from engine.speculative.proposer import proposer_for
from engine.step_timings import StepClock, StepTimingLog, step_timing
from engine.structured.cursors import GrammarCursors
from engine.structured.model_grammars import ModelGrammars

_ENDED_STATUSES = (SequenceStatus.FINISHED, SequenceStatus.HANDED_OFF)


@dataclass(frozen=True, slots=True)
class StepResult:
    new_tokens: list[TokenEvent]  # one per sample that got a token this step
    finished: list[RequestOutput]  # requests that completed this step
    handed_off: list[PrefillResult]  # prefill-only requests whose KV now waits under a lease


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens computed for prompts (and recomputes), not decodes
    step_seconds: float = 0.0  # wall time of step() calls that ran the model
    step_thread_cpu_seconds: float = 0.0  # the engine thread's CPU time in them
    forward_seconds: float = 0.0  # of which model forward + logits
    num_drafts: int = 0  # speculative decoding: sequences' steps that checked drafts
    num_draft_tokens: int = 0  # the drafts computed and checked
    num_accepted_draft_tokens: int = 0  # of which stood


class LLMEngine:
    def __init__(
        self,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        speculative: SpeculativeConfig | None = None,
        parallel: ParallelConfig | None = None,
        *,
        record_kv_events: bool = False,
        weights: LoadedWeights | None = None,
    ) -> None:
        """``parallel``: the worker's tensor-parallel ranks, of which this engine is rank 0
        (its followers run engine/parallel/follower.py with the same configs); None: one.
        ``record_kv_events``: note the blocks the prefix cache stores and removes, for
        ``take_kv_events`` (a worker's, which the router's index follows). ``weights``: the
        model of an engine this worker ran before (its ``keep_for_next_role()``), kept instead
        of loaded again; a tensor-parallel worker's, with its group: its followers, running
        still, rebuild on theirs as this engine builds."""
        parallel = parallel or ParallelConfig()
        check_configs(load, cache, scheduler, speculative, parallel)
        group = rank0_group(load, cache, scheduler, speculative, parallel, weights)
        # rank 0 of the worker's ranks (None: the worker is this one rank)
        self.group: TensorParallelGroup | None = group
        try:
            rank = build_rank_model(load, cache, scheduler, speculative, group, weights, parallel)
        except BaseException:
            self.close()
            raise
        self.model_config: ModelConfig = rank.model_config
        self.device = rank.device
        self.dtype = rank.dtype
        self.max_model_len = rank.max_model_len
        self.model = rank.model
        # what it computes with, whole: a worker that changes role keeps its weights (and
        # cache) for its next engine (``RankModel.loaded_weights``)
        self.rank_model = rank
        self.shard = rank.shard
        # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]; this rank's heads
        self.kv_cache = rank.kv_cache
        # a quantized cache's scales for the whole model (None: the cache stores the model's
        # dtype); the layout handshake checks a peer's are the same
        self.kv_cache_scales = rank.kv_cache_scales
        self._num_threads_before = rank.num_threads_before  # restored on close()
        num_blocks = rank.num_kv_blocks
        eos = frozenset(self.model_config.eos_token_ids)
        rope = self.model_config.rope
        self._kv_events = KVEventRecorder() if record_kv_events else None
        self.block_manager = BlockManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            # LongRoPE: a prompt past the pre-training length is computed with the long set
            rope.original_max_position_embeddings if rope.scaling_type == "longrope" else None,
            self.model_config.cache_groups,
            self._kv_events,
            rank.num_host_slots,
        )
        proposer = proposer_for(speculative, rank.drafter, scheduler.max_num_seqs)
        # structured outputs: compiled on the first request that asks (and checked there)
        tokenizer_dir, vocab_size = load.tokenizer or load.model_dir, self.model_config.vocab_size
        self.grammars = ModelGrammars(tokenizer_dir, vocab_size, eos, load.trust_remote_code)
        grammar_cursors = GrammarCursors(self.grammars, eos, self.device)
        self.scheduler = Scheduler(
            scheduler, self.block_manager, eos, proposer, grammar_cursors.valid_drafts
        )
        moe = self.model_config.moe
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            rank.attn_backend,
            eos,
            self.device,
            rank.decode_graphs,
            # a pass of prompt logits fits in what the memory profile keeps for sampling
            max_prompt_logits_rows=scheduler.max_num_seqs,
            grammar_cursors=grammar_cursors,
            group=self.group,
            expert_tokens=None if moe is None else ExpertTokenCounts(moe),
            host_kv_cache=rank.host_kv_cache,
            drafter=rank.drafter,
        )
        self._num_ranks = 1 if self.group is None else self.group.size
        self.stats = EngineStats()
        self.step_timings = StepTimingLog()  # for the worker's load reports
        # async scheduling: the step launched ahead, to be sampled and applied by the next step()
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._requests: dict[str, RequestState] = {}
        # decode side: request id -> blocks its KV comes into (which hand-off holds them, and
        # until when, is the decode worker's: decode_worker/handoffs.py)
        self._reservations: dict[str, list[int]] = {}
        # decode side: request id -> how many leading blocks of its reservation this cache
        # held already (their KV does not move)
        self._num_shared_reserved: dict[str, int] = {}
        # blocks held for another worker's fetch of a prefix (lend id -> the blocks), and, on
        # the side that fetched it, for the request that will use it (request id -> blocks)
        self._lent: dict[str, list[int]] = {}
        self._prefix_holds: dict[str, tuple[int, list[int]]] = {}  # (how many are cached)

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        prefill_only: bool = False,
        resume_token_ids: Mapping[int, SequenceOf[int]] | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field.

        ``prefill_only``: stop after each sample's first token and keep the prompt's KV under
        a lease; the step that gets there reports a PrefillResult instead of tokens to come.
        ``resume_token_ids``: output tokens (by sample index) that were already generated
        elsewhere; only those samples continue, after them, as if they had never stopped.
        ``priority``: lower runs first under the scheduling policy "priority"; only 0 under
        "fcfs".
        """
        token_ids = self._validated_request(request_id, prompt_token_ids, params)
        self._validate_priority(priority)
        if resume_token_ids:
            self._add_resumed(request_id, token_ids, params, resume_token_ids, cache_salt, priority)
            return
        seq = Sequence(
            self.scheduler.new_seq_id(),
            request_id,
            token_ids,
            params,
            self._max_total_tokens(len(token_ids), params),
            seed=params.seed,
            cache_salt=cache_salt,
            prefill_only=prefill_only,
            prompt_logprobs=params.prompt_logprobs is not None,
            priority=priority,
        )
        self.scheduler.add(seq)
        state = RequestState(request_id, prompt, params, num_samples=params.n)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs_chunks = []
        state.record(seq, None)
        self._requests[request_id] = state

    def _add_resumed(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Mapping[int, SequenceOf[int]],
        cache_salt: str | None,
        priority: int,
    ) -> None:
        state = RequestState(request_id, None, params, num_samples=len(resume_token_ids))
        arrival: int | None = None  # the request's samples arrive together
        for index, outputs in sorted(resume_token_ids.items()):
            if not 0 <= index < params.n:
                raise ValueError(f"resume_token_ids has sample index {index}; n is {params.n}")
            self._validate_token_ids("resume_token_ids", outputs)
            seed = None if params.seed is None else derive_seed(params.seed, index)
            seq = Sequence(
                self.scheduler.new_seq_id(),
                request_id,
                token_ids,
                params,
                self._max_total_tokens(len(token_ids), params),
                sample_index=index,
                seed=seed,
                cache_salt=cache_salt,
                priority=priority,
                arrival=arrival,
            )
            arrival = seq.arrival
            seq.token_ids.extend(outputs)
            if seq.num_tokens >= seq.max_total_tokens:
                raise ValueError(
                    f"resume_token_ids[{index}] already holds the request's {len(outputs)} "
                    "tokens: nothing left to generate"
                )
            seq.is_forked = True
            if seed is not None and not params.greedy:
                self.runner.replay_generator(
                    seq.seq_id, seed, len(outputs), self.model_config.vocab_size
                )
            self.scheduler.add(seq)
            state.record(seq, None)
        self._requests[request_id] = state

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is: queued, running, or handed off under a lease."""
        self.cancel_reservation(request_id)
        state = self._requests.pop(request_id, None)
        if state is None:  # (a prefix held for a request still to come stays: its fetch ends)
            return
        self.drop_prefix_hold(request_id)
        for seq in self.scheduler.abort(request_id):
            self.runner.forget(seq.seq_id)
        for seq in state.seqs.values():
            self.scheduler.release(seq)
            self.runner.forget(seq.seq_id)
        self._drop_step_of_ended_requests()

    def _drop_step_of_ended_requests(self) -> None:
        """Async scheduling: with no request left, the step launched ahead computes only
        sequences that have ended; nothing of it is wanted (it is left to run out)."""
        if not self._requests:
            self._in_flight = None

    def has_request(self, request_id: str) -> bool:
        """The request is queued, running or handed off here (a mere reservation is not)."""
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def keep_for_next_role(self, keep_kv_cache: bool) -> LoadedWeights:
        """What the engine of this worker's next role builds on (``weights``): its weights,
        its KV cache with ``keep_kv_cache``, and its ranks' group with the followers running
        (this engine's ``close`` no longer stops them). It must never step again: its loop
        stops before the next engine builds on them."""
        group, self.group = self.group, None
        self._num_threads_before = None  # (the next engine gives them back)
        return self.rank_model.loaded_weights(keep_kv_cache, group)

    def close(self) -> None:
        """Stop the worker's followers, leave their group and give this process back the
        torch threads it had (nothing for a worker of one rank). The engine cannot step
        afterwards. Idempotent."""
        group, self.group = self.group, None
        if group is None:
            return
        threads, self._num_threads_before = getattr(self, "_num_threads_before", None), None
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            if hasattr(self, "runner"):
                self.runner.stop_followers()
        except (ConnectionError, TimeoutError):
            pass  # a follower already gone: its process is stopped by whoever started it
        finally:
            group.close()

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one scheduling step: the tokens it produced and the requests it finished.

        With async scheduling the step's forward was launched by the step before, and this one
        launches the next (scheduled before this step's tokens are known) before it waits for
        them: the host's scheduling, input building and bookkeeping overlap the GPU's forward.
        """
        started = StepClock.start()
        if self.scheduler.config.async_scheduling:
            return self._step_ahead(started)
        output = self.scheduler.schedule()
        if output.is_empty:
            self._move_blocks_of_empty(output)
            return StepResult([], [], [])
        self._note_scheduled(output)
        return self._apply(output, self.runner.execute(output), started)

    def _step_ahead(self, started: StepClock) -> StepResult:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:  # nothing launched ahead: schedule and launch this step now
            in_flight = self._launch(self.scheduler.schedule())
            if in_flight is None:
                return StepResult([], [], [])
        output, launched = in_flight
        sampled = self.runner.sample(launched)
        # the next step, ahead of this one's tokens (empty where it would have to preempt)
        self._in_flight = self._launch(self.scheduler.schedule(step_in_flight=True))
        return self._apply(output, sampled.result(), started)

    def _launch(self, output: SchedulerOutput) -> tuple[SchedulerOutput, LaunchedStep] | None:
        if output.is_empty:
            self._move_blocks_of_empty(output)
            return None
        self._note_scheduled(output)
        launched = self.runner.launch(output)
        self.scheduler.commit_launched(output)  # a prompt admitted ahead finds its blocks
        return output, launched

    def _move_blocks_of_empty(self, output: SchedulerOutput) -> None:
        """A step that computes nothing still makes the block moves its scheduling owed: blocks
        brought back from the host tier for a sequence that did not fit stay cached under their
        hashes, so their content must land before any later step reads them."""
        if output.moves_blocks:
            self.runner.move_blocks(output)

    def _note_scheduled(self, output: SchedulerOutput) -> None:
        self._note_first_scheduled(output, time.monotonic())
        self.stats.num_prefill_tokens += _num_prefill_tokens(output)

    def _apply(
        self, output: SchedulerOutput, result: ModelRunnerOutput, started: StepClock
    ) -> StepResult:
        """A step's results into the sequences; its tokens and the requests it ended."""
        shape = step_timing(output, 0.0)  # (what it computed, before the sequences move on)
        updated = self.scheduler.update(output, result)
        self.runner.draft_after(output)  # a draft model's drafts for the next step
        self._record_prompt_logprobs(output, result)
        new_tokens: list[TokenEvent] = []
        ended: dict[str, RequestState] = {}  # requests with a sample finished or handed off
        for appended in updated:
            seq, num_tokens = appended.seq, appended.num_tokens
            state = self._requests[seq.request_id]
            num_output = seq.num_output_tokens
            for token_logprobs, position in zip(
                _appended_logprobs(result, seq.seq_id, num_tokens),
                range(num_output - num_tokens, num_output),
            ):
                state.record(seq, token_logprobs)
                newest = position == num_output - 1
                new_tokens.append(self._token_event(state, seq, position, newest, token_logprobs))
            if seq.status in _ENDED_STATUSES:
                ended[state.request_id] = state
        # only a request one of whose samples ended in this step can have ended in it
        finished = [self._finish(state) for state in ended.values() if state.is_finished]
        handed_off = [
            self._prefill_result(state)
            for state in ended.values()
            if not state.is_finished and state.is_handed_off
        ]
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(new_tokens)
        self.stats.num_drafts += len(result.accepted_drafts)
        for drafts in result.accepted_drafts.values():
            self.stats.num_draft_tokens += drafts.num_drafts
            self.stats.num_accepted_draft_tokens += len(drafts.token_ids)
        self.stats.forward_seconds += result.forward_seconds
        seconds, thread_cpu_s = started.elapsed()
        self.stats.step_seconds += seconds
        self.stats.step_thread_cpu_seconds += thread_cpu_s
        self.step_timings.record(replace(shape, seconds=seconds))
        self._drop_step_of_ended_requests()
        return StepResult(new_tokens, finished, handed_off)

    def _token_event(
        self,
        state: RequestState,
        seq: Sequence,
        position: int,
        newest: bool,
        token_logprobs: TokenLogprobs | None,
    ) -> TokenEvent:
        """The event of ``seq``'s output token at ``position``; the ``newest`` carries the
        finish."""
        first = position == 0
        return TokenEvent(
            request_id=seq.request_id,
            sample_index=seq.sample_index,
            position=position,
            token_id=seq.token_ids[seq.num_prompt_tokens + position],
            logprobs=token_logprobs,
            finish_reason=seq.finish_reason if newest else None,
            num_cached_tokens=state.parent.num_cached_prompt_tokens if first else 0,
            queue_seconds=(state.queue_seconds or 0.0) if first else 0.0,
            prompt_logprobs=state.prompt_logprobs if first and seq.sample_index == 0 else None,
        )

    def _record_prompt_logprobs(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        if not result.prompt_logprobs:
            return
        for entry in output.scheduled:
            chunk = result.prompt_logprobs.get(entry.seq.seq_id)
            state = self._requests.get(entry.seq.request_id)
            if chunk is not None and state is not None:  # None: aborted while the step ran
                state.record_prompt_logprobs(chunk)

    def _note_first_scheduled(self, output: SchedulerOutput, now: float) -> None:
        for entry in output.scheduled:
            state = self._requests.get(entry.seq.request_id)
            if state is not None and state.queue_seconds is None:
                state.queue_seconds = max(0.0, now - state.arrived_at)

    # ---- disaggregated serving ----------------------------------------------------------
    def release_lease(self, request_id: str) -> None:
        """Prefill side: the decode side has the KV (or gave up); free the blocks.

        Full blocks stay in the prefix cache until evicted.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self.drop_prefix_hold(request_id)
        for seq in state.seqs.values():
            self.scheduler.release(seq)
            self.runner.forget(seq.seq_id)

    def reserve_blocks(
        self, request_id: str, num_tokens: int, prefix_hashes: SequenceOf[BlockHash] = ()
    ) -> list[int] | None:
        """Decode side: blocks to receive a prompt's KV into; None if they don't fit now.

        ``prefix_hashes``: the prompt's block hashes (``PrefillResult.prompt_block_hashes``).
        The leading blocks this cache holds already come first, shared, and their KV need not
        move (``num_shared_reserved``); at least the prompt's last block is always fresh.
        """
        if request_id in self._reservations or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        manager = self.block_manager
        servable = num_servable_blocks(num_tokens, manager.block_size)
        shared = manager.share_cached_prefix(prefix_hashes[:servable])
        blocks = manager.reserve(num_tokens, shared)
        if blocks is None:
            manager.release(shared)
            return None
        self._swap_out_now()
        self._reservations[request_id] = blocks
        self._num_shared_reserved[request_id] = len(shared)
        return list(blocks)

    def num_shared_reserved(self, request_id: str) -> int:
        """How many leading blocks of the request's reservation this cache held already."""
        return self._num_shared_reserved.get(request_id, 0)

    def _swap_out_now(self) -> None:
        """Copy to the host tier, and wait for it, the cached blocks a reservation evicted: the
        KV a hand-off receives lands in them outside any step, so no step's moves would come
        first. (Between steps no other swap is owed: each step's building takes its own.)"""
        swap_outs, swap_ins = self.block_manager.take_swaps()
        if swap_outs or swap_ins:
            self.runner.swap_blocks(swap_outs, swap_ins, wait=True)

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        blocks = self._reservations.get(request_id)
        return None if blocks is None else list(blocks)

    def cancel_reservation(self, request_id: str) -> None:
        self._num_shared_reserved.pop(request_id, None)
        self.block_manager.release(self._reservations.pop(request_id, []))

    # ---- a prefix's KV fetched from another worker (reuse across the cluster) -------------
    def servable_prompt_hashes(
        self, prompt_token_ids: SequenceOf[int], cache_salt: str | None
    ) -> list[BlockHash]:
        """The prefix hashes of a prompt's blocks a cache can serve, as this engine names them
        (the tenant's salt, and the long-prompt mark of a LongRoPE model)."""
        return self.block_manager.servable_prompt_hashes(prompt_token_ids, cache_salt)

    def lend_blocks(self, lend_id: str, hashes: SequenceOf[BlockHash]) -> list[int]:
        """The side that holds a prefix: the blocks caching the leading run of ``hashes``, held
        (never evicted) until ``return_lent`` so another worker can copy them; [] for none."""
        if lend_id in self._lent:
            raise ValueError(f"lend id {lend_id!r} is already in use")
        held = self.block_manager.share_cached_prefix(hashes)
        if held:
            self._lent[lend_id] = held
        return list(held)

    def lent_blocks(self, lend_id: str) -> list[int]:
        """The blocks ``lend_blocks`` holds for ``lend_id`` ([] when none: returned already)."""
        return list(self._lent.get(lend_id, []))

    def return_lent(self, lend_id: str) -> None:
        """The blocks of ``lend_blocks`` are copied (or will not be): no longer held."""
        self.block_manager.release(self._lent.pop(lend_id, []))

    def hold_prefix(
        self, request_id: str, hashes: SequenceOf[BlockHash]
    ) -> tuple[int, list[int]] | None:
        """The side that fetches a prefix, before adding the request: the leading blocks of
        ``hashes`` this cache holds, held for the request (how many), and fresh blocks for the
        rest to arrive in (give the ones that did to ``received_prefix``); None when they do
        not fit now (nothing is held then)."""
        if request_id in self._prefix_holds or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        manager = self.block_manager
        held = manager.share_cached_prefix(hashes)
        fresh = manager.take_fresh(len(hashes) - len(held))
        if fresh is None:
            manager.release(held)
            return None
        self._swap_out_now()  # (the KV lands in them outside any step)
        self._prefix_holds[request_id] = (len(held), held + fresh)
        return len(held), list(fresh)

    def received_prefix(
        self, request_id: str, hashes: SequenceOf[BlockHash], num_received: int
    ) -> None:
        """``hashes``: those given to ``hold_prefix``. The first ``num_received`` fresh blocks
        now hold the blocks they name after the ones held here: a prefix lookup finds them. The
        other fresh blocks are given back; the rest stay held for the request until it ends
        (so no eviction takes them before its prefill does)."""
        num_held, blocks = self._prefix_holds[request_id]
        end = num_held + num_received
        self.block_manager.register_received(blocks[num_held:end], hashes[num_held:end])
        self.block_manager.release(blocks[end:])
        self._prefix_holds[request_id] = (end, blocks[:end])

    def drop_prefix_hold(self, request_id: str) -> None:
        """The request's held prefix blocks (``hold_prefix``) are no longer held for it."""
        _, blocks = self._prefix_holds.pop(request_id, (0, []))
        self.block_manager.release(blocks)

    def admit_prefilled(self, result: PrefillResult, *, kv_received: bool) -> None:
        """Decode side: continue the unfinished samples of a request prefilled elsewhere.

        ``kv_received``: the prompt's KV arrived in the blocks reserved for it. Otherwise (the
        transfer failed and the request's policy is to recompute) the prompt runs here again;
        the first tokens the prefill side sampled are kept either way.
        """
        request_id = result.request_id
        blocks = self._reservations.pop(request_id, None)
        self._num_shared_reserved.pop(request_id, None)
        seqs: list[Sequence] = []
        try:
            if kv_received and blocks is None:
                raise ValueError(f"request {request_id!r} has no reserved blocks to admit")
            token_ids = self._validated_request(request_id, result.prompt_token_ids, result.params)
            self._validate_priority(result.priority)
            samples = result.unfinished_samples
            if not samples:
                raise ValueError(f"request {request_id!r} has no unfinished sample to decode")
            for sample in samples:
                arrival = seqs[0].arrival if seqs else None  # the samples arrive together
                seqs.append(self._admitted_sequence(result, token_ids, sample, arrival))
                # before any block is adopted: this cache may be smaller than the prefill side's
                self.scheduler.check_fits(seqs[-1])
        except ValueError:
            for seq in seqs:
                self.runner.forget(seq.seq_id)
            self.block_manager.release(blocks or [])
            raise
        state = RequestState(request_id, None, result.params, num_samples=len(samples))
        for position, (seq, sample) in enumerate(zip(seqs, samples)):
            if kv_received and blocks is not None:
                self.block_manager.adopt(seq, blocks, share=position > 0)
                self.scheduler.add_computed(seq)
            else:
                self.scheduler.add(seq)
            state.record(seq, sample.logprobs)
        if not kv_received:
            self.block_manager.release(blocks or [])
        self._requests[request_id] = state

    @property
    def records_kv_events(self) -> bool:
        return self._kv_events is not None

    def take_kv_events(self) -> tuple[KVBlocksEvent, ...]:
        """The blocks the cache stored and removed since the last call, in order (none unless
        the engine records them)."""
        return () if self._kv_events is None else self._kv_events.take()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def counters(
        self,
        num_kv_transfers: int = 0,
        num_kv_transfer_bytes: int = 0,
        kv_transfer_seconds: float = 0.0,
    ) -> WorkerCounters:
        """This engine's totals for the worker's load report, with the worker's KV transfers."""
        pool = self.block_manager.pool
        block_size = self.block_manager.block_size
        expert_tokens = self.runner.expert_tokens
        host, copier = self.block_manager.host, self.runner.host_copier
        num_host_hit_blocks = 0 if host is None else host.num_hit_blocks
        # every rank moves the same blocks of its own heads, as many bytes as rank 0's
        offloaded, loaded = (0, 0) if copier is None else copier.num_bytes_moved
        return WorkerCounters(
            num_generated_tokens=self.stats.num_generated_tokens,
            num_steps=self.stats.num_steps,
            step_seconds=self.stats.step_seconds,
            step_thread_cpu_seconds=self.stats.step_thread_cpu_seconds,
            num_prefill_tokens=self.stats.num_prefill_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_queried_tokens=pool.num_cache_queries * block_size,
            num_prefix_cache_hit_tokens=pool.num_cache_hits * block_size,
            num_prefix_cache_host_hit_tokens=num_host_hit_blocks * block_size,
            num_kv_offloaded_bytes=offloaded * self._num_ranks,
            num_kv_loaded_bytes=loaded * self._num_ranks,
            num_kv_transfers=num_kv_transfers,
            num_kv_transfer_bytes=num_kv_transfer_bytes,
            kv_transfer_seconds=kv_transfer_seconds,
            num_draft_attempts=self.scheduler.num_draft_attempts,
            num_drafts=self.stats.num_drafts,
            num_draft_tokens=self.stats.num_draft_tokens,
            num_accepted_draft_tokens=self.stats.num_accepted_draft_tokens,
            expert_tokens=() if expert_tokens is None else expert_tokens.per_expert(),
            expert_layer_imbalance=() if expert_tokens is None else expert_tokens.layer_imbalance(),
        )

    # ---- helpers ------------------------------------------------------------------------
    def _finish(self, state: RequestState) -> RequestOutput:
        del self._requests[state.request_id]
        self.drop_prefix_hold(state.request_id)
        for seq in state.seqs.values():
            self.runner.forget(seq.seq_id)
        return state.output()

    def _prefill_result(self, state: RequestState) -> PrefillResult:
        handed_off = [s for s in state.seqs.values() if s.status is SequenceStatus.HANDED_OFF]
        num_servable = num_servable_blocks(
            state.parent.num_prompt_tokens, self.block_manager.block_size
        )
        samples = tuple(
            SampleStart(
                index=index,
                first_token_id=seq.output_token_ids[0],
                logprobs=state.logprobs[index][0] if index in state.logprobs else None,
                finish_reason=seq.finish_reason,
                generator_state=self.runner.generator_state(seq.seq_id),
            )
            for index, seq in sorted(state.seqs.items())
        )
        return PrefillResult(
            request_id=state.request_id,
            prompt_token_ids=state.parent.prompt_token_ids,
            params=state.params,
            cache_salt=state.parent.cache_salt,
            samples=samples,
            block_ids=self.block_manager.blocks_to_hand_off(handed_off[0]),
            num_cached_tokens=state.parent.num_cached_prompt_tokens,
            priority=state.parent.priority,
            prompt_block_hashes=tuple(handed_off[0].block_hashes[:num_servable]),
        )

    def _admitted_sequence(
        self,
        result: PrefillResult,
        token_ids: list[int],
        sample: SampleStart,
        arrival: int | None,
    ) -> Sequence:
        params = result.params
        seed = None if params.seed is None else derive_seed(params.seed, sample.index)
        seq = Sequence(
            self.scheduler.new_seq_id(),
            result.request_id,
            token_ids,
            params,
            self._max_total_tokens(len(token_ids), params),
            sample_index=sample.index,
            seed=seed,
            cache_salt=result.cache_salt,
            priority=result.priority,
            arrival=arrival,
        )
        seq.token_ids.append(sample.first_token_id)
        seq.is_forked = True
        if sample.generator_state is not None and seed is not None:
            self.runner.restore_generator(seq.seq_id, seed, sample.generator_state)
        return seq

    def _max_total_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        if params.max_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, num_prompt_tokens + params.max_tokens)

    def _validate_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {type(priority).__name__}")
        policy = self.scheduler.config.policy
        if priority != 0 and policy != "priority":
            raise ValueError(
                f"priority must be 0 under the scheduling policy {policy!r}, got {priority}; "
                "set the scheduling policy 'priority' to order requests by it"
            )

    def _validated_request(
        self, request_id: str, prompt_token_ids: SequenceOf[int], params: SamplingParams
    ) -> list[int]:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._validated_prompt(prompt_token_ids)
        self._validate_token_ids("stop_token_ids", params.stop_token_ids)
        # SamplingParams checked these ids are ints >= 0; only the model knows its vocabulary
        self._validate_token_ids("allowed_token_ids", params.allowed_token_ids or ())
        self._validate_token_ids("logit_bias", list(params.logit_bias or ()))
        if params.bad_words and not params.bad_words_token_ids:
            raise ValueError(
                "bad_words must be tokenized into bad_words_token_ids before they reach the "
                "engine (LLM.generate and the gateway do it)"
            )
        for i, bad_word in enumerate(params.bad_words_token_ids):
            self._validate_token_ids(f"bad_words_token_ids[{i}]", bad_word)
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            self._validate_token_ids("structured_outputs.after_token_ids", spec.after_token_ids)
            self.grammars(spec)  # compiled now: a bad one is refused here
        return token_ids

    def _validated_prompt(self, prompt_token_ids: SequenceOf[int]) -> list[int]:
        token_ids = list(prompt_token_ids)
        if not token_ids:
            raise ValueError("prompt must contain at least 1 token")
        self._validate_token_ids("prompt_token_ids", token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for at least one output token"
            )
        return token_ids

    def _validate_token_ids(self, field_name: str, token_ids: SequenceOf[int]) -> None:
        vocab_size = self.model_config.vocab_size
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"{field_name} must hold ints, got {type(token).__name__}")
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"{field_name} holds token id {token}, outside the vocabulary [0, {vocab_size})"
                )


def _appended_logprobs(
    result: ModelRunnerOutput, seq_id: int, num_tokens: int
) -> list[TokenLogprobs | None]:
    """The logprobs of a sequence's ``num_tokens`` newest tokens, oldest first: drafts that
    stood, then the token sampled after them (which a finish on a draft leaves out)."""
    drafts = result.accepted_drafts.get(seq_id)
    if drafts is None:  # one token (a finish cannot cut it)
        return [result.logprobs.get(seq_id)]
    return [*drafts.logprobs, result.logprobs.get(seq_id)][:num_tokens]


def _num_prefill_tokens(output: SchedulerOutput) -> int:
    """Tokens of a step that were not a running sequence's one decode token."""
    return sum(
        entry.num_new_tokens
        for entry in output.scheduled
        if entry.num_new_tokens > 1 or entry.seq.num_output_tokens == 0
    )
