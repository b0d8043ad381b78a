"""A discrete-event simulation of a pdserve cluster serving a workload, on a simulated clock.

Each worker is the engine's own scheduler and block manager (engine/scheduler, engine/kv_cache:
pure CPU), so batching, chunked prefill, the prefix cache, block shortage and preemption follow
the workers' rules exactly; only the model is replaced by a step time (``StepTimes``: a step's
shape, as ``engine.step_timings`` records it, to seconds). A worker steps back to back while it
has work: a step is scheduled, takes its time, then its tokens are applied (every sampled token
an ordinary one: outputs run to their length).

Routing is the router's own policy (``router_policy``, router/policies.py), fed the workers'
loads as the router sees them (each worker's report, polled every ``report_interval_s``, plus
the requests routed to it that the report may not show: router/load_ledger.py) and, for
kv_aware, a KV index that follows the workers' prefix caches (their KV events, applied before
every decision: the real router's view lags by an output batch at most):
least_loaded sends a prompt to the prefill worker (colocated: the decode worker) with the fewest
queued prompt tokens, its decode worker the one of lowest KV usage; kv_aware weighs each
worker's cached prefix of the prompt against its queue and, disaggregated, the decode workers'
caches too (``KVAware.choose_reuse``, as router/placements.py asks it): a decode worker holding
a prefix of the prompt prefills the rest itself (a local prefill: no hand-off), or a prefill
worker first copies the prefix from it (a fetch, ``transfer_seconds`` for the blocks it lacks;
best effort, as the worker's: what does not fit or is no longer cached is computed) and hands
back only what that decode worker does not hold.

In a disaggregated layout a prompt's first token leaves the prefill worker with the step that
samples it; its KV then moves to the decode worker once that worker has blocks for it, taking
``transfer_seconds`` for its blocks less the prefix the decode worker's own cache holds (shared,
as a decode worker reserves them), and the decode worker continues it. Every request's first
token also takes ``path_overhead_s`` (the gateway's and router's hops).

On a CPU machine (``host``) the workers have no device of their own: their steps and the
host's other work share its cores (router/planner/shared_host.py): a step takes longer while
more threads want to run than there are cores. After each step the worker's own process makes
its outputs (CPU time per step's batch and per token, before its next step: its threads share
one interpreter lock); then the front door's threads receive the batch and stream each token to
its client, and a token reaches its client once its streaming is done; each hand-off's copies
and calls run in the prefill worker's process after the outputs of the step that finished its
prompt, and the KV moves once they are done. Elsewhere each worker computes on its own devices, a step takes
its time alone and a token is delivered as it is sampled.

With a host tier (``WorkerShape.num_host_slots``) a worker's block manager keeps the blocks its
cache evicts, and a step first copies its evictions out and its prefix hits there back
(``seconds_per_swapped_block`` each). With speculative decoding (``ClusterShape.speculation``,
router/planner/speculation.py) the scheduler asks a proposer for each decoding sequence's
drafts, the step computes them, and those that stand are drawn.

Out: each request's arrival, first token and last token times, from which TTFT, TPOT and
goodput follow (``SimulatedRequest``), and where its first token's time went: when a step
first computed its prompt, and when the step that sampled the token ended.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.cache_groups import CacheGroups
from engine.kv_cache.kv_events import KVEventRecorder
from engine.kv_cache.prefix_hash import BlockHash, num_servable_blocks, servable_block_hashes
from engine.messages import WorkerLoad
from engine.messages.kv_events import KVCacheSnapshot, KVEventBatch, KVEventsReply
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.scheduler.outputs import ModelRunnerOutput
from engine.sequence import Sequence as EngineSequence
from engine.sequence import SequenceStatus
from engine.step_timings import roofline_counts, step_timing
from router.kv_aware import KVAware
from router.kv_index import KVIndex
from router.latency_model import StepShape, shape_of
from router.load_ledger import LoadLedger, charge_routed
from router.local_prefill import LocalPrefillRule
from router.planner.shared_host import HostShare, SharedHost
from router.planner.speculation import DraftChecks, PlannedDrafts, Speculation
from router.policies import LeastLoaded, RoutingInfo, RoutingPolicy

# every sampled token (never an end of sequence: the scheduler is given none); a conversation's
# next turn holds its replies as these
SAMPLED_TOKEN = 7

StepTimes = Callable[[StepShape], float]  # a step's seconds on one worker
ROUTER_POLICIES = ("kv_aware", "least_loaded")  # those simulated; the first is serve's default


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadRequest:
    arrival_s: float  # a conversation's next turn: not before its earlier turn's
    prompt_token_ids: tuple[int, ...]
    output_len: int
    # a conversation's next turn: sent ``think_s`` after this earlier turn's last token reached
    # its client (its prompt holds that turn's prompt and reply)
    follows: WorkloadRequest | None = None
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """One pool's workers: how each schedules and how long its steps take."""

    count: int
    step_times: StepTimes
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int = 256
    threads: int = 1  # cores a busy worker computes on (on a shared host)
    # a host-memory tier of the prefix cache (--kv-offload-gb): the blocks it holds, and the
    # seconds a block takes to copy between it and the device (to or from), before the step
    num_host_slots: int = 0
    seconds_per_swapped_block: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterShape:
    decode: WorkerShape
    prefill: WorkerShape | None = None  # None: colocated, the decode workers prefill
    block_size: int = 16
    transfer_seconds: Callable[[int], float] = lambda num_blocks: 0.0
    path_overhead_s: float = 0.0
    router_policy: str = "kv_aware"
    host: HostShare | None = None  # the cores the workers share (a CPU machine); None: devices
    # kv_aware may have a prefill worker copy a prefix from a decode worker (the router's
    # rule: between workers of one rank each)
    prefix_fetch: bool = True
    # the router's load poll: it routes on each worker's latest report plus the requests routed
    # to it that the report may not show (router/load_ledger.py); 0: on the loads as they are
    report_interval_s: float = 0.5
    # the router's conditional disaggregation: short prompts, or prompts arriving while the
    # prefill pool is backlogged, prefilled on their decode worker (router/local_prefill.py)
    local_prefill: LocalPrefillRule = field(default_factory=LocalPrefillRule)
    # speculative decoding on the workers that decode (router/planner/speculation.py)
    speculation: Speculation | None = None
    # the model's KV cache groups (sliding windows kept apart); None: one of every layer
    cache_groups: CacheGroups | None = None

    def __post_init__(self) -> None:
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, "
                f"not {self.router_policy!r}"
            )


@dataclass(slots=True)
class SimulatedRequest:
    request: WorkloadRequest
    # the first token's way: when a step first computed its prompt, when the step that
    # sampled it ended, when it reached its client
    scheduled_s: float | None = None
    prompt_done_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    num_delivered: int = 0  # tokens that reached the client
    sent_s: float | None = None  # when it was sent (a next turn's: once its earlier one ended)

    @property
    def arrival_s(self) -> float:
        return self.request.arrival_s if self.sent_s is None else self.sent_s

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None or self.num_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)

    @property
    def done(self) -> bool:
        return self.num_tokens >= self.request.output_len


@dataclass(slots=True)
class StepTotals:
    """A worker's steps over a run: their time alone, and as they ran (longer on a shared
    host, while other work takes cores from them)."""

    num_steps: int = 0
    alone_s: float = 0.0
    wall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Route:
    prompt: _Worker  # prefills the prompt: its decode worker, or a prefill worker
    decode: _Worker
    fetch_blocks: int = 0  # the prompt's first blocks the prefill worker copies from ``decode``


@dataclass(slots=True)
class _Worker:
    name: str
    shape: WorkerShape
    scheduler: Scheduler
    busy: bool = False
    step_started_s: float = 0.0  # the step under way's
    steps: StepTotals = field(default_factory=StepTotals)
    # hand-offs waiting for this (decode) worker's blocks, in arrival order
    handoffs: deque[EngineSequence] = field(default_factory=deque)
    kv_events: KVEventRecorder | None = None  # its prefix cache's, for kv_aware's index
    num_event_batches: int = 0  # batches of them the index has
    ledger: LoadLedger = field(default_factory=LoadLedger)  # its load, as the router sees it


class Simulation:
    def __init__(self, cluster: ClusterShape, requests: Sequence[WorkloadRequest]) -> None:
        self.cluster = cluster
        self.requests = [SimulatedRequest(r) for r in sorted(requests, key=lambda r: r.arrival_s)]
        # a conversation's next turns, by the turn they follow (sent once it ends)
        of_request = {id(s.request): s for s in self.requests}
        self._next_turns: dict[int, list[SimulatedRequest]] = {}
        for simulated in self.requests:
            earlier = simulated.request.follows
            if earlier is None:
                continue
            if id(earlier) not in of_request:
                raise ValueError("a next turn follows a request that is not simulated")
            self._next_turns.setdefault(id(earlier), []).append(simulated)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._seq_ids = itertools.count()
        self.decode = [
            self._worker(f"decode-{i}", cluster.decode) for i in range(cluster.decode.count)
        ]
        prefill = cluster.prefill
        self.prefill = (
            []
            if prefill is None
            else [self._worker(f"prefill-{i}", prefill) for i in range(prefill.count)]
        )
        self._workers = (*self.prefill, *self.decode)
        self._by_name = {w.name: w for w in self._workers}
        self._of_seq: dict[int, SimulatedRequest] = {}
        self._decode_of: dict[int, _Worker] = {}  # prefill seq id -> its decode worker
        self._prefill_of: dict[int, _Worker] = {}  # handed-off seq id -> its prefill worker
        # prefill seq id -> the blocks a fetch holds in its prefill worker's cache until it ends
        self._fetched_holds: dict[int, list[int]] = {}
        # kv_aware's reuse of the decode workers' caches: prompts prefilled by their decode
        # worker ("cached"), prompts whose prefill worker fetched a prefix, blocks fetched
        self.num_local_prefills = 0
        self.num_fetches = 0
        self.num_fetched_blocks = 0
        # the host tiers' traffic: blocks evicted to them, prefix hits copied back from them
        self.num_blocks_to_host = 0
        self.num_blocks_from_host = 0
        self._open: set[str] = set()  # the requests routed and not finished, by id
        self._num_finished = 0
        self._index = KVIndex()
        self._draft_checks = (
            None if cluster.speculation is None else DraftChecks(cluster.speculation)
        )
        self._host = (
            None if cluster.host is None else SharedHost(cluster.host, lambda: self.now, self._at)
        )
        self._policy: RoutingPolicy = (
            KVAware(
                cluster.block_size,
                self._index,
                colocated=not self.prefill,
                fetch=cluster.prefix_fetch,
            )
            if cluster.router_policy == "kv_aware"
            else LeastLoaded()
        )

    def _worker(self, name: str, shape: WorkerShape) -> _Worker:
        events = KVEventRecorder() if self.cluster.router_policy == "kv_aware" else None
        manager = BlockManager(
            shape.num_kv_blocks,
            self.cluster.block_size,
            enable_prefix_caching=True,
            cache_groups=self.cluster.cache_groups,
            kv_events=events,
            num_host_slots=shape.num_host_slots,
        )
        config = SchedulerConfig(
            max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens
        )
        speculation = self.cluster.speculation
        proposer = (
            None if speculation is None else PlannedDrafts(speculation, SAMPLED_TOKEN, seed=name)
        )
        scheduler = Scheduler(config, manager, eos_token_ids=(), proposer=proposer)
        return _Worker(name, shape, scheduler, kv_events=events)

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> list[SimulatedRequest]:
        if self.cluster.report_interval_s > 0:  # (the first before any arrival)
            self._at(0.0, self._report)
        for simulated in self.requests:
            if simulated.request.follows is None:
                self._at(simulated.request.arrival_s, functools.partial(self._arrive, simulated))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return self.requests

    def steps_by_role(self) -> dict[str, StepTotals]:
        """The workers' steps, summed over those of each role ("prefill", "decode")."""
        totals: dict[str, StepTotals] = {}
        for role, workers in (("prefill", self.prefill), ("decode", self.decode)):
            for worker in workers:
                total = totals.setdefault(role, StepTotals())
                total.num_steps += worker.steps.num_steps
                total.alone_s += worker.steps.alone_s
                total.wall_s += worker.steps.wall_s
        return totals

    def _report(self) -> None:
        """The router's load poll: every worker's load now, into its ledger (which drops the
        charges it shows); again after the interval while any request is unfinished."""
        for worker in self._workers:
            worker.ledger.record(_load(worker), self.now, self._open.__contains__)
        if self._num_finished < len(self.requests):
            self._at(self.now + self.cluster.report_interval_s, self._report)

    def _loads(self, workers: Sequence[_Worker]) -> list[WorkerLoad]:
        """The workers' loads as the router sees them."""
        if self.cluster.report_interval_s <= 0:
            return [_load(w) for w in workers]
        return [w.ledger.load or _load(w) for w in workers]

    def _charge(self, route: _Route, request_id: str, num_prompt_tokens: int) -> None:
        """The router counts a routed request towards its workers (as WorkerPool.charge), the
        prompt worker holding it at once."""
        prefill = None if route.prompt is route.decode else route.prompt.ledger
        charge_routed(request_id, prefill, route.decode.ledger, num_prompt_tokens, 1)
        route.prompt.ledger.mark_held(request_id, self.now)

    def _at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), action))

    def _arrive(self, simulated: SimulatedRequest) -> None:
        request = simulated.request
        simulated.sent_s = self.now
        seq_id = next(self._seq_ids)
        route = self._route(RoutingInfo(f"r{seq_id}", request.prompt_token_ids))
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        handed_off = route.prompt is not route.decode
        seq = EngineSequence(
            seq_id,
            f"r{seq_id}",
            list(request.prompt_token_ids),
            params,
            len(request.prompt_token_ids) + request.output_len,
            prefill_only=handed_off,
            arrival=seq_id,
        )
        self._of_seq[seq_id] = simulated
        self._open.add(seq.request_id)
        self._charge(route, seq.request_id, len(request.prompt_token_ids))
        if handed_off:
            self._decode_of[seq_id] = route.decode
        route.prompt.scheduler.check_fits(seq)
        if route.fetch_blocks:
            self._fetch(route, seq)
        else:
            self._queue(route.prompt, seq)

    def _queue(self, worker: _Worker, seq: EngineSequence) -> None:
        worker.scheduler.add(seq)
        self._kick(worker)

    def _route(self, routing: RoutingInfo) -> _Route:
        """Where the prompt is prefilled and decoded, as the router's policy places it on the
        workers as they are now (router/placements.py)."""
        self._publish_kv_events()
        decode_loads = self._loads(self.decode)
        if not self.prefill:  # colocated: the decode worker prefills
            chosen = self._by_name[self._policy.choose_decode(routing, decode_loads)]
            return _Route(chosen, chosen)
        decode = self._by_name[self._policy.choose_decode(routing, decode_loads)]
        prefill_loads = self._loads(self.prefill)
        decode_load = next(w for w in decode_loads if w.worker_id == decode.name)
        rule = self.cluster.local_prefill
        if rule.reason(len(routing.prompt_token_ids), prefill_loads, decode_load) is not None:
            self.num_local_prefills += 1
            return _Route(decode, decode)
        if isinstance(self._policy, KVAware):
            reuse = self._policy.choose_reuse(routing, prefill_loads, decode_loads)
            if reuse is not None:
                holder = self._by_name[reuse.decode_worker_id]
                if reuse.prefill_worker_id is None:
                    self.num_local_prefills += 1
                    return _Route(holder, holder)
                return _Route(self._by_name[reuse.prefill_worker_id], holder, reuse.fetch_blocks)
        return _Route(self._by_name[self._policy.choose_prefill(routing, prefill_loads)], decode)

    def _fetch(self, route: _Route, seq: EngineSequence) -> None:
        """The prefill worker copies the prompt's first ``route.fetch_blocks`` blocks from the
        decode worker caching them (those its own cache lacks, of the leading run the decode
        worker still holds), then queues the prompt, its prefix held in its cache until the
        hand-off (prefill_worker/prefix_fetch.py)."""
        hashes = servable_block_hashes(seq.prompt_token_ids, self.cluster.block_size, None)
        hashes = hashes[: route.fetch_blocks]
        manager = route.prompt.scheduler.block_manager
        held = manager.share_cached_prefix(hashes)
        lent = route.decode.scheduler.block_manager.share_cached_prefix(hashes)
        fresh = manager.take_fresh(max(0, len(lent) - len(held)))
        if not fresh:  # nothing to copy, or no room for it: the prompt computes the rest
            route.decode.scheduler.block_manager.release(lent)
            self._fetched_holds[seq.seq_id] = held
            self._queue(route.prompt, seq)
            return
        self.num_fetches += 1
        self.num_fetched_blocks += len(fresh)
        done = functools.partial(self._fetched, route, seq, hashes, held, lent, fresh)
        self._at(self.now + self.cluster.transfer_seconds(len(fresh)), done)

    def _fetched(
        self,
        route: _Route,
        seq: EngineSequence,
        hashes: list[BlockHash],
        held: list[int],
        lent: list[int],
        fresh: list[int],
    ) -> None:
        route.decode.scheduler.block_manager.release(lent)
        route.prompt.scheduler.block_manager.register_received(
            fresh, hashes[len(held) : len(held) + len(fresh)]
        )
        self._fetched_holds[seq.seq_id] = held + fresh
        self._queue(route.prompt, seq)

    def _publish_kv_events(self) -> None:
        """The workers' prefix-cache events since the last decision, into kv_aware's index."""
        for worker in self._workers:
            if worker.kv_events is None:
                continue
            events = worker.kv_events.take()
            if not events and worker.num_event_batches:
                continue
            first = worker.num_event_batches == 0
            worker.num_event_batches += 1
            number = worker.num_event_batches
            self._index.apply(
                worker.name,
                KVEventsReply(
                    worker.name,
                    number,
                    KVCacheSnapshot(0, ()) if first else None,
                    (KVEventBatch(number, events),),
                ),
            )

    def _kick(self, worker: _Worker) -> None:
        """Start the worker's next step if it is idle and has work."""
        if worker.busy or not worker.scheduler.num_unfinished:
            return
        output = worker.scheduler.schedule()
        if output.is_empty:
            return  # waits for blocks: a hand-off or a finish kicks it again
        shape = shape_of(step_timing(output, 0.0))
        groups = self.cluster.cache_groups
        if groups is not None or self.cluster.speculation is not None:
            # (else they are the reported counts: every layer sees its whole context, no
            # sequence's drafts share its KV read)
            kv_tokens, pairs = roofline_counts(output, groups)
            shape = replace(shape, decode_kv_tokens=kv_tokens, attention_pairs=pairs)
        for entry in output.scheduled:
            simulated = self._of_seq[entry.seq.seq_id]
            if simulated.scheduled_s is None:
                simulated.scheduled_s = self.now
        worker.busy = True
        done = functools.partial(self._step_done, worker, output)
        seconds = worker.shape.step_times(shape)
        # blocks evicted to the host tier and prefix hits copied back, before the forward
        swapped = len(output.swap_outs) + len(output.swap_ins)
        seconds += swapped * worker.shape.seconds_per_swapped_block
        self.num_blocks_to_host += len(output.swap_outs)
        self.num_blocks_from_host += len(output.swap_ins)
        worker.step_started_s = self.now
        worker.steps.num_steps += 1
        worker.steps.alone_s += seconds
        if self._host is None:
            self._at(self.now + seconds, done)
        else:
            self._host.start(worker.name, seconds, worker.shape.threads, done)

    def _step_done(self, worker: _Worker, output: SchedulerOutput) -> None:
        worker.steps.wall_s += self.now - worker.step_started_s
        sampled = {
            seq.seq_id: SAMPLED_TOKEN for entry in output.scheduled for seq in entry.sample_seqs
        }
        checked = {} if self._draft_checks is None else self._draft_checks.check(output.scheduled)
        result = ModelRunnerOutput(sampled, accepted_drafts=checked)
        appended = worker.scheduler.update(output, result)
        handed = [t.seq for t in appended if t.seq.status is SequenceStatus.HANDED_OFF]
        deliveries: list[tuple[int, Callable[[], None]]] = []  # (tokens, their delivery)
        for tokens in appended:
            simulated = self._of_seq[tokens.seq.seq_id]
            if simulated.prompt_done_s is None:  # its decode worker holds it from here on
                simulated.prompt_done_s = self.now
                for held_by in self._workers:
                    held_by.ledger.mark_held(tokens.seq.request_id, self.now)
            was_done = simulated.done
            simulated.num_tokens += tokens.num_tokens
            if simulated.done and not was_done:  # it no longer counts towards any worker
                self._num_finished += 1
                self._open.discard(tokens.seq.request_id)
                for charged in self._workers:
                    charged.ledger.drop(tokens.seq.request_id)
            deliveries.append(
                (
                    tokens.num_tokens,
                    functools.partial(self._delivered, simulated, tokens.num_tokens),
                )
            )
        if self._host is None:  # on a device of its own: each token out as it is sampled
            for _, deliver in deliveries:
                deliver()
            self._after_step(worker, handed)
            return
        # on a shared host the worker's process makes the step's outputs first (one batch)
        share = self._host.share
        made = functools.partial(self._outputs_made, worker, deliveries, handed)
        num_tokens = sum(n for n, _ in deliveries)
        seconds = num_tokens * share.worker_seconds_per_token
        if deliveries:
            seconds += share.worker_seconds_per_batch
        self._in_worker(worker, seconds, made)

    def _outputs_made(
        self,
        worker: _Worker,
        deliveries: list[tuple[int, Callable[[], None]]],
        handed: list[EngineSequence],
    ) -> None:
        """A step's outputs leave the worker's process: its tokens are streamed on the host's
        cores, in order, after the streaming before them; then its hand-offs' copies and calls
        run in the process."""
        assert self._host is not None
        share = self._host.share
        streamed = [(n * share.seconds_per_token, d) for n, d in deliveries]
        if streamed:  # the batch is received before any of its tokens streams
            streamed[0] = (streamed[0][0] + share.seconds_per_batch, streamed[0][1])
        self._host.stream(streamed)
        after = functools.partial(self._after_step, worker, handed)
        self._in_worker(worker, len(handed) * share.seconds_per_handoff, after)

    def _in_worker(self, worker: _Worker, seconds: float, then: Callable[[], None]) -> None:
        """``seconds`` of CPU work in the worker's own process (on one core of the shared
        host), then ``then()``: at once when there is none."""
        if seconds > 0:
            assert self._host is not None
            self._host.start(worker.name, seconds, 1, then)
        else:
            then()

    def _after_step(self, worker: _Worker, handed: list[EngineSequence]) -> None:
        """The worker is free for its next step; the prompts its step finished hand off."""
        for seq in handed:
            self._hand_off(worker, seq)
        worker.busy = False
        self._kick(worker)
        if worker in self.decode:  # blocks may have come free for the hand-offs waiting
            self._start_handoffs(worker)

    def _delivered(self, simulated: SimulatedRequest, num_tokens: int) -> None:
        """Tokens of the request reach its client (now, and the path's hops); after its last,
        its conversation's next turn is sent when the user has thought."""
        at = self.now + self.cluster.path_overhead_s
        if simulated.first_token_s is None:
            simulated.first_token_s = at
        simulated.last_token_s = at
        simulated.num_delivered += num_tokens
        if simulated.num_delivered >= simulated.request.output_len:
            for turn in self._next_turns.pop(id(simulated.request), []):
                send = functools.partial(self._arrive, turn)
                self._at(max(at + turn.request.think_s, turn.request.arrival_s), send)

    # ---- hand-offs ------------------------------------------------------------------------
    def _hand_off(self, prefill: _Worker, seq: EngineSequence) -> None:
        decode = self._decode_of.pop(seq.seq_id)
        decode.handoffs.append(seq)
        self._prefill_of[seq.seq_id] = prefill
        self._start_handoffs(decode)

    def _start_handoffs(self, decode: _Worker) -> None:
        """Reserve blocks for the hand-offs waiting, in order, while they fit; each moves its
        KV, then continues on the decode worker."""
        manager = decode.scheduler.block_manager
        while decode.handoffs:
            seq = decode.handoffs[0]
            num_servable = num_servable_blocks(seq.num_prompt_tokens, self.cluster.block_size)
            shared = manager.share_cached_prefix(seq.block_hashes[:num_servable])
            blocks = manager.reserve(seq.num_prompt_tokens, shared)
            if blocks is None:
                manager.release(shared)
                return
            decode.handoffs.popleft()
            seconds = self.cluster.transfer_seconds(len(blocks) - len(shared))
            self._at(self.now + seconds, functools.partial(self._received, decode, seq, blocks))

    def _received(self, decode: _Worker, handed: EngineSequence, blocks: list[int]) -> None:
        prefill = self._prefill_of.pop(handed.seq_id)
        prefill.scheduler.release(handed)  # the prefill worker's lease ends
        prefill.scheduler.block_manager.release(self._fetched_holds.pop(handed.seq_id, []))
        self._kick(prefill)
        simulated = self._of_seq.pop(handed.seq_id)
        if simulated.done:  # one output token: nothing to decode
            decode.scheduler.block_manager.release(blocks)
            self._kick(decode)  # (a sequence waiting for blocks may fit now)
            self._start_handoffs(decode)
            return
        seq_id = next(self._seq_ids)
        seq = EngineSequence(
            seq_id,
            handed.request_id,
            handed.prompt_token_ids,
            handed.params,
            handed.max_total_tokens,
            arrival=seq_id,
        )
        seq.token_ids.append(SAMPLED_TOKEN)  # the first token, sampled by the prefill worker
        seq.num_computed_tokens = seq.num_tokens - 1
        decode.scheduler.block_manager.adopt(seq, blocks, share=False)
        decode.scheduler.add_computed(seq)
        self._of_seq[seq_id] = simulated
        self._kick(decode)


def _load(worker: _Worker) -> WorkerLoad:
    """The worker's load report, as the router would have it."""
    scheduler = worker.scheduler
    return WorkerLoad(
        worker.name,
        len(scheduler.waiting),
        len(scheduler.running),
        scheduler.num_queued_prompt_tokens,
        scheduler.block_manager.usage,
    )
