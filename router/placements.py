"""Where each request runs: its placement on a prefill and a decode worker, its tokens into its
tracker, and its recovery when a worker it was on is lost.

Life of a placement (``RequestTracker.placing`` while it is being made):
  choosing   -- the policy picks among the routable workers' loads (a first placement: among
                those the request is allowed, admission's, where any of them is routable); the
                choice counts towards their load at once
  submitting -- the chosen worker is asked to take it (outside the lock: a worker takes a
                request between two engine steps); a worker found dead here is taken out of
                rotation and the choice made again, each try a placement id of its own
  placed     -- tokens flow in through ``dispatch``; a retryable failure resumes the request
                elsewhere, after the tokens its client already has
  ended      -- finished, failed or aborted: untracked, its workers told to drop it
Trackers change only through this class's methods.

Locks: ``_lock`` guards the trackers; it is taken before the pool's (``router.worker_pool``).
A method whose name ends in ``_locked`` expects its caller to hold ``_lock``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import ray

from engine.messages import (
    FirstTokenTrace,
    GenerateRequest,
    OutputBatch,
    RequestFailure,
    TokenEvent,
    WorkerLoad,
)
from router.cluster_config import ClusterConfig
from router.kv_aware import KVAware, KVAwareWeights, PrefixHitStats
from router.kv_index import KVIndex
from router.latency_forecast import AllowedWorkers
from router.local_prefill import LOCAL_PREFILL_REASONS
from router.policies import (
    POLICY_NAMES,
    LeastLoaded,
    NoWorkerError,
    PrefixAffinity,
    RoundRobin,
    RoutingInfo,
    RoutingPolicy,
)
from router.request_tracker import ClientItem, RequestTracker
from router.worker_pool import WorkerHandle, WorkerPool
from router.worker_slots import CALL_TIMEOUT_S

logger = logging.getLogger("router.cluster")
_PLACEMENT_SEPARATOR = "#"  # a later placement's id: request id, separator, placement number


class RequestFailedError(RuntimeError):
    """The cluster could not complete a request; the message says why."""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request is placed: the workers, and how the prompt reaches the decode worker."""

    prefill_id: str | None  # None: the decode worker prefills it itself
    decode_id: str
    local: str | None  # why the decode worker prefills it (router/local_prefill.py, "cached")
    fetch_blocks: int = 0  # the prefill worker first copies this many prefix blocks from it


class Placements:
    def __init__(self, config: ClusterConfig, pool: WorkerPool) -> None:
        self.config = config
        self.pool = pool
        self.policy = make_policy(
            config.router_policy,
            config.block_size,
            pool.kv_index,
            config.kv_aware,
            colocated=config.colocated,
            # a prefix's KV is copied between workers of one rank each (prefix_fetch.py)
            fetch=config.prefill_tp == 1 and config.decode_tp == 1,
        )
        self._lock = threading.RLock()
        self._trackers: dict[str, RequestTracker] = {}  # by request id
        self._placed: dict[str, RequestTracker] = {}  # by placement id (what workers know)
        self._local_prefills: Counter[str] = Counter()  # reason -> prompts (LocalPrefillRule)

    # ---- requests -----------------------------------------------------------------------
    def submit(
        self,
        request: GenerateRequest,
        sink: Callable[[ClientItem], None],
        allowed: AllowedWorkers | None = None,
    ) -> RequestTracker:
        """Route and submit a request; its events go to ``sink`` (from other threads).
        ``allowed``: the workers its first placement is chosen among, those of them the routing
        could use (admission's: those predicted to make its SLOs); a placement after a
        worker's loss is chosen among all."""
        placing_at = time.time()
        with self._lock:
            if request.request_id in self._trackers or request.request_id in self._placed:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            tracker = RequestTracker(request, sink, None, "")
            tracker.stamps.placing_at = placing_at
            self._trackers[request.request_id] = tracker
        try:
            self._place(tracker, request, self.config.dead_after_s, allowed)
        except BaseException:
            with self._lock:
                self._forget_locked(tracker)
            raise
        return tracker

    def abort(self, request_id: str) -> None:
        with self._lock:
            tracker = self._trackers.get(request_id)
            if tracker is not None:
                self._end_locked(tracker)

    def is_open(self, request_id: str) -> bool:
        """Whether a request has not ended yet (read without the lock: one dict lookup)."""
        return request_id in self._trackers

    def tracker(self, request_id: str) -> RequestTracker | None:
        with self._lock:
            return self._trackers.get(request_id)

    def open_trackers(self) -> list[RequestTracker]:
        """The requests not ended yet."""
        with self._lock:
            return list(self._trackers.values())

    def num_open(self) -> int:
        return len(self._trackers)

    def num_placed_on(self, worker_id: str) -> int:
        """Requests whose current placement uses the worker (not ended yet)."""
        with self._lock:
            return sum(
                1
                for t in self._trackers.values()
                if worker_id in (t.prefill_worker, t.decode_worker)
                or (t.placing and worker_id in t.candidates)
            )

    def queued_prompts(self) -> dict[str, list[tuple[int, int]]]:
        """By worker: (priority, prompt tokens) of each request placed there to be prefilled
        whose first token has not come yet (the latency forecast's queues by priority).

        Read without the lock (a snapshot of the trackers, their fields as they are): the front
        doors ask on their event loop, which must not wait while a recovery holds the lock; an
        estimate a request out of date is as good."""
        queued: dict[str, list[tuple[int, int]]] = {}
        for tracker in list(self._trackers.values()):
            if tracker.placing or tracker.has_delivered:
                continue
            worker = tracker.prefill_worker or tracker.decode_worker
            request = tracker.request
            queued.setdefault(worker, []).append((request.priority, len(request.prompt_token_ids)))
        return queued

    def local_prefills(self) -> dict[str, int]:
        """Prompts routed to be prefilled on their decode worker so far, by reason."""
        with self._lock:
            return {reason: self._local_prefills[reason] for reason in LOCAL_PREFILL_REASONS}

    def prefix_hit_stats(self) -> PrefixHitStats | None:
        """The hit tokens of the prompts ``kv_aware`` routed so far (None: another policy)."""
        with self._lock:
            if isinstance(self.policy, KVAware):
                return self.policy.stats.snapshot()
            return None

    def _forget_locked(self, tracker: RequestTracker) -> None:
        """Stop tracking a request that ended ; late events about it are dropped, and it no
        longer counts towards its workers' loads."""
        if self._trackers.get(tracker.request_id) is tracker:
            del self._trackers[tracker.request_id]
            self.pool.drop_charges(tracker.request_id)
        for placement_id in tracker.placement_ids:
            if self._placed.get(placement_id) is tracker:
                del self._placed[placement_id]

    # ---- placing ----------------------------------------------------------------------------
    def _place(
        self,
        tracker: RequestTracker,
        request: GenerateRequest,
        wait_s: float,
        allowed: AllowedWorkers | None = None,
    ) -> None:
        """Pick workers for a (re)submitted request (among ``allowed``, see ``submit``) and
        send it there, waiting up to ``wait_s`` for a worker to take it (one that takes longer
        is taken out as stalled).

        The lock is taken to choose and to record, not while the worker accepts: holding it
        meanwhile would stall every other request's tokens for up to a step. While
        ``tracker.placing``, tokens from the workers being asked are accepted, their failure
        reports are held, and a worker's loss does not see the request; so once the worker has
        accepted, the choice is checked again against losses meanwhile. (A re-route after a
        failure runs with the lock held by its caller; it is rare.)
        """
        tracker.placing = True
        given_up: list[tuple[str, str]] = []  # (worker, placement id): accepted, given up
        try:
            for _ in range(len(self.pool.workers)):
                route = self._choose(request, allowed)
                prefill_id, decode_id, local = route.prefill_id, route.decode_id, route.local
                if not tracker.has_delivered:  # (its first token is yet to come)
                    tracker.stamps.routed_at = time.time()
                with self._lock:
                    placement_id = self._new_placement_locked(tracker)
                    tracker.candidates = tuple(w for w in (prefill_id, decode_id) if w)
                target = self.pool.get(prefill_id or decode_id)
                placed = replace(request, request_id=placement_id)
                decode_target = decode_id if prefill_id else None
                fetch_blocks = route.fetch_blocks
                if not self._submit_to(
                    target, placed, decode_target, fetch_blocks, tracker, wait_s
                ):
                    continue
                if self._record_placement(tracker, prefill_id, decode_id, local):
                    return
                given_up.append((target.worker_id, placement_id))
                request = tracker.resume_request()  # a chosen worker died after accepting
            raise RequestFailedError("no live worker accepted the request")
        finally:
            tracker.placing = False
            tracker.candidates = ()
            for worker_id, placement_id in given_up:
                self._abort_on({worker_id}, placement_id)

    def _submit_to(
        self,
        target: WorkerHandle,
        placed: GenerateRequest,
        decode_id: str | None,
        fetch_blocks: int,
        tracker: RequestTracker,
        wait_s: float,
    ) -> bool:
        """Ask ``target`` to take a placement of ``tracker``'s request (a prefill worker: for
        ``decode_id``, first copying ``fetch_blocks`` of its prefix from it); False if it is
        lost (out of rotation, its other requests recovered). A slow worker is waited for up
        to ``wait_s``."""
        stamps = None if tracker.has_delivered else tracker.stamps  # (first token yet to come)
        try:
            if stamps is not None:
                stamps.submit_sent_at = time.time()
            if decode_id is None:
                ref = target.actor.submit.remote(placed)
            elif fetch_blocks > 0:
                ref = target.actor.submit.remote(placed, decode_id, fetch_blocks)
            else:
                ref = target.actor.submit.remote(placed, decode_id)
            ray.get(ref, timeout=wait_s)
            if stamps is not None:
                stamps.submit_returned_at = time.time()
        except ray.exceptions.RayActorError:
            self._lose(target, skip=tracker)
            return False
        except ray.exceptions.GetTimeoutError:
            self._lose(target, skip=tracker, stalled=True)
            target.actor.abort.remote(placed.request_id)  # it may take it when it wakes
            return False
        return True

    def _new_placement_locked(self, tracker: RequestTracker) -> str:
        """A fresh placement id for the request, the one its workers will know it by: the
        request id for the first placement, then ``<request id>#<n>``, never an id in use. Reports about an earlier placement are stale from now on."""
        request_id = tracker.request_id
        number = len(tracker.placement_ids)
        while True:
            placement_id = f"{request_id}{_PLACEMENT_SEPARATOR}{number}" if number else request_id
            if placement_id not in self._placed and (
                not number or placement_id not in self._trackers
            ):
                break
            number += 1
        tracker.placement_id = placement_id
        tracker.held_failure = None  # it was about the placement given up
        if self._trackers.get(request_id) is tracker:  # (not aborted meanwhile)
            tracker.placement_ids.append(placement_id)
            self._placed[placement_id] = tracker
        return placement_id

    def _choose(self, request: GenerateRequest, allowed: AllowedWorkers | None = None) -> Route:
        """Where the request goes, among the routable workers (those ``allowed`` of them, if
        any is); no prefill worker when the decode worker prefills it (colocated, resumed, or
        a local prefill: the reason). The choice counts towards their load at once, so
        requests routed meanwhile see it."""
        info = RoutingInfo(request.request_id, request.prompt_token_ids, request.cache_salt)
        with self._lock:
            try:
                decode_loads = _among(
                    self.pool.routable_loads("decode"),
                    None if allowed is None else allowed.decode_worker_ids,
                )
                if self.config.colocated or request.resume_token_ids:
                    route = Route(None, self.policy.choose_decode(info, decode_loads), None)
                else:
                    prefill_loads = _among(
                        self.pool.routable_loads("prefill"),
                        None if allowed is None else allowed.prompt_worker_ids,
                    )
                    route = self._choose_disaggregated_locked(info, prefill_loads, decode_loads)
            except NoWorkerError as error:
                raise RequestFailedError(str(error)) from error
            self.pool.charge_routed(route.prefill_id, route.decode_id, request)
        return route

    def _choose_disaggregated_locked(
        self, info: RoutingInfo, prefill_loads: list[WorkerLoad], decode_loads: list[WorkerLoad]
    ) -> Route:
        """A prefill worker and a decode worker for a new prompt of a disaggregated cluster,
        or the decode worker alone when it prefills the prompt itself: a short prompt, a
        prefill backlog (router/local_prefill.py), or, under kv_aware, a decode worker holding
        its prefix ("cached", router/kv_aware.py; or a prefill worker copies the prefix from
        it first)."""
        decode_id = self.policy.choose_decode(info, decode_loads)
        local = self.config.local_prefill.reason(
            len(info.prompt_token_ids), prefill_loads, self.pool.load_of(decode_id)
        )
        if local is not None:
            return Route(None, decode_id, local)
        if isinstance(self.policy, KVAware):
            reuse = self.policy.choose_reuse(info, prefill_loads, decode_loads)
            if reuse is not None and reuse.prefill_worker_id is None:
                return Route(None, reuse.decode_worker_id, "cached")
            if reuse is not None:
                return Route(
                    reuse.prefill_worker_id, reuse.decode_worker_id, None, reuse.fetch_blocks
                )
        return Route(self.policy.choose_prefill(info, prefill_loads), decode_id, None)

    def _record_placement(
        self, tracker: RequestTracker, prefill_id: str | None, decode_id: str, local: str | None
    ) -> bool:
        """Note where an accepted request runs; False if a chosen worker was lost meanwhile.

        The worker that accepted it holds it from now on: load reports asked for later show it.
        """
        accepted_at = time.monotonic()
        with self._lock:
            self.pool.mark_held(tracker.request_id, accepted_at, prefill_id or decode_id)
            if not all(self.pool.is_alive(w) for w in (prefill_id, decode_id) if w is not None):
                return False
            if local is not None:
                self._local_prefills[local] += 1
            if tracker.started_decoding:
                prefill_id = None  # the prefill part is over already
            tracker.prefill_worker, tracker.decode_worker = prefill_id, decode_id
            tracker.placing = False
            held, tracker.held_failure = tracker.held_failure, None
            if tracker.closed:  # aborted while placing: the abort saw no workers yet
                self._abort_on({w for w in (prefill_id, decode_id) if w}, tracker.placement_id)
            elif held is not None:
                self._on_failure_locked(*held)
        return True

    def _abort_on(self, worker_ids: set[str], placement_id: str) -> None:
        """Tell those of ``worker_ids`` whose process may live (in rotation, or stalled) to drop
        a placement (not waiting for them)."""
        for worker_id in sorted(worker_ids):
            worker = self.pool.get(worker_id)
            if worker.alive or worker.stalled:
                worker.actor.abort.remote(placement_id)

    # ---- outputs ------------------------------------------------------------------------
    def dispatch(self, batch: OutputBatch, received_at: float | None = None) -> None:
        """Carry one output batch of a worker into the trackers of its requests. ``received_at``:
        when the gateway received the batch (``time.time()``; default: now), for first tokens'
        traces."""
        if batch.kv_events is not None:  # the step's blocks, before its tokens reach a client
            self.pool.follow_kv_events(batch.worker_id, batch.kv_events)
        with self._lock:
            for event in batch.events:
                tracker = self._placed.get(event.request_id)
                if tracker is None or not tracker.sent_by_its_workers(
                    batch.worker_id, event.request_id
                ):
                    continue  # finished, or from a placement given up
                if event.position == 0 and event.sample_index == 0:
                    # A prefill is done: its decode worker holds the request from here on (the
                    # KV hand-off leaves with the first token; colocated, it held it already).
                    self.pool.mark_held(tracker.request_id, time.monotonic())
                    if event.first_token_trace is not None:
                        event = _traced_here(event, event.first_token_trace, batch, received_at)
                try:
                    tracker.accept(event)
                except Exception:  # its client cannot be reached (its event loop closed):
                    # nobody reads it, and the batch's other requests go on
                    logger.exception("client of %s unreachable; aborting it", tracker.request_id)
                    self._end_locked(tracker)
                    continue
                if tracker.prefill_worker is not None and tracker.started_decoding:
                    tracker.prefill_worker = None  # first tokens out, decoding begun: prefill over
                if tracker.closed:
                    self._forget_locked(tracker)
            for failure in batch.failures:
                self._on_failure_locked(failure, batch.worker_id)

    def _on_failure_locked(self, failure: RequestFailure, worker_id: str) -> None:
        """A worker gave up on a request: resume it elsewhere if the failure allows a retry
        and its decode worker does not hold it after all, else fail it. Reports from a
        placement given up meanwhile are stale: the request has moved on."""
        tracker = self._placed.get(failure.request_id)
        if tracker is None or not tracker.sent_by_its_workers(worker_id, failure.request_id):
            return
        if tracker.placing:
            tracker.held_failure = (failure, worker_id)
            return
        if failure.retryable:
            if self._continues_on_decode_worker_locked(tracker):
                return
            if self._trackers.get(tracker.request_id) is not tracker:
                return  # its decode worker was found dead, and that recovered it
            if tracker.num_retries < self.config.max_retries:
                self._resume_locked(tracker)
                return
        self._end_locked(tracker, failure.message)

    def _end_locked(self, tracker: RequestTracker, failure: str | None = None) -> None:
        """Stop a request: untracked, its client sent ``failure`` (None: it left or
        aborted, nothing is sent), and its live workers told to drop its placement."""
        self._forget_locked(tracker)
        if failure is None:
            tracker.closed = True
        else:
            tracker.fail(failure)
        self._abort_on(tracker.workers, tracker.placement_id)

    def _continues_on_decode_worker_locked(self, tracker: RequestTracker) -> bool:
        """Whether the request's decode worker holds it (a failure report came too late)."""
        decode = self.pool.workers.get(tracker.decode_worker)
        if decode is None or not decode.alive:
            return False
        try:
            ref = decode.actor.has_request.remote(tracker.placement_id)
            return bool(ray.get(ref, timeout=CALL_TIMEOUT_S))
        except ray.exceptions.RayActorError:
            self._lose(decode, skip=tracker)
        except ray.exceptions.GetTimeoutError:
            self._lose(decode, skip=tracker, stalled=True)
        return False

    # ---- recovery -----------------------------------------------------------------------
    def recover(self, lost: list[WorkerHandle]) -> None:
        """Recover the requests on workers the pool took out of rotation."""
        for worker in lost:
            with self._lock:
                self._recover_all_locked(worker)

    def _lose(
        self, worker: WorkerHandle, skip: RequestTracker | None = None, *, stalled: bool = False
    ) -> None:
        """Take a worker found dead here out of rotation and recover its requests but ``skip``
        (the one being placed)."""
        with self._lock:
            if self.pool.take_out(worker, stalled=stalled):
                self._recover_all_locked(worker, skip)

    def _recover_all_locked(self, worker: WorkerHandle, skip: RequestTracker | None = None) -> None:
        """Recover every request on a worker taken out of rotation; a stalled one (its process
        may live on) is told to drop each (``_abort_on``). A request whose recovery fails (a
        bug) is failed, never left waiting, and the others are recovered all the same."""
        affected = [
            t
            for t in self._trackers.values()
            if worker.worker_id in (t.prefill_worker, t.decode_worker) and t is not skip
        ]
        for tracker in affected:
            # a loss found while recovering an earlier one may have recovered it already
            if not self._still_placed_on_locked(tracker, worker):
                continue
            try:
                self._recover_locked(tracker, worker)
            except Exception:
                logger.exception(
                    "recovering %s from %s failed", tracker.request_id, worker.worker_id
                )
                with contextlib.suppress(Exception):  # (its client may be gone)
                    self._end_locked(tracker, "internal error while re-routing the request")

    def _still_placed_on_locked(self, tracker: RequestTracker, worker: WorkerHandle) -> bool:
        """The request is still tracked and still placed on ``worker``."""
        placed_on = worker.worker_id in (tracker.prefill_worker, tracker.decode_worker)
        return placed_on and self._trackers.get(tracker.request_id) is tracker

    def _recover_locked(self, tracker: RequestTracker, lost: WorkerHandle) -> None:
        """Move a request off a lost worker: it stays on its decode worker, is pointed at
        another, or is resumed elsewhere (or fails, out of retries). The lost worker, if its
        process may live on, is told to drop it whichever way it goes."""
        if lost.role == "prefill" and tracker.has_delivered:
            # The first token left: the decode worker may hold the request already (and
            # recomputes it if its KV never comes). If it does not, resume it there.
            if self._continues_on_decode_worker_locked(tracker):
                self._abort_on({lost.worker_id}, tracker.placement_id)
                tracker.prefill_worker = None
                return
            if self._trackers.get(tracker.request_id) is not tracker:
                return  # its decode worker was found dead too, and that recovered it
        elif lost.role == "decode" and not tracker.has_delivered and self._retarget_locked(tracker):
            self._abort_on({lost.worker_id}, tracker.placement_id)
            return
        if tracker.num_retries >= self.config.max_retries:
            self._end_locked(
                tracker, f"{lost.role} worker {lost.worker_id} failed; retries exhausted"
            )
            return
        self._resume_locked(tracker)

    def _retarget_locked(self, tracker: RequestTracker) -> bool:
        """Point a request still prefilling at another live decode worker; False if none
        can take it or the prefill worker has handed it off already."""
        prefill = self.pool.workers.get(tracker.prefill_worker or "")
        if prefill is None or not prefill.alive:
            return False
        info = RoutingInfo(tracker.request_id, tracker.request.prompt_token_ids)
        try:
            decode_id = self.policy.choose_decode(info, self.pool.routable_loads("decode"))
        except NoWorkerError:
            return False
        ref = prefill.actor.retarget.remote(tracker.placement_id, decode_id)
        with contextlib.suppress(ray.exceptions.RayError):
            if ray.get(ref, timeout=CALL_TIMEOUT_S):
                tracker.decode_worker = decode_id
                self.pool.charge_decode(decode_id, tracker.request_id, tracker.request.params.n)
                return True
        return False

    def _resume_locked(self, tracker: RequestTracker) -> None:
        """Submit the request again, continuing after the tokens the client already has. The
        placement given up sends nothing more to the client, and its live workers drop it: a
        decode worker may still admit its copy (a hand-off that failed late, or whose prefill
        worker died before its first token got out), and that copy would run unseen."""
        self._abort_on(tracker.workers, tracker.placement_id)
        tracker.num_retries += 1
        tracker.prefill_worker, tracker.decode_worker = None, ""
        try:
            # under the lock, which holds up every request's tokens: a shorter wait
            self._place(
                tracker, tracker.resume_request(), min(CALL_TIMEOUT_S, self.config.dead_after_s)
            )
        except (RequestFailedError, ValueError, ray.exceptions.RayError) as error:
            self._end_locked(tracker, f"could not re-route the request: {error}")


def _among(loads: list[WorkerLoad], worker_ids: frozenset[str] | None) -> list[WorkerLoad]:
    """The loads of ``worker_ids`` (None: all); all where none of them is among the loads."""
    if worker_ids is None:
        return loads
    return [load for load in loads if load.worker_id in worker_ids] or loads


def make_policy(
    name: str,
    block_size: int,
    kv_index: KVIndex | None = None,
    kv_aware_weights: KVAwareWeights | None = None,
    *,
    colocated: bool = False,
    fetch: bool = True,
) -> RoutingPolicy:
    """The routing policy ``name``; kv_aware reads ``kv_index`` (the pool's) and, ``colocated``
    (no prefill pool), chooses decode workers by their caches too; ``fetch``: it may have
    prefill workers copy prefixes from decode workers' caches."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_affinity":
        return PrefixAffinity(block_size)
    if name == "kv_aware":
        if kv_index is None:
            raise ValueError("router policy kv_aware needs the pool's KV index")
        return KVAware(block_size, kv_index, kv_aware_weights, colocated=colocated, fetch=fetch)
    raise ValueError(f"router policy must be one of {', '.join(POLICY_NAMES)}; got {name!r}")


def _traced_here(
    event: TokenEvent, trace: FirstTokenTrace, batch: OutputBatch, received_at: float | None
) -> TokenEvent:
    """A first token's event with the gateway's stamps of its batch: streamed by the worker,
    received by the pump, and handed to its request's sink (now)."""
    sunk_at = time.time()
    trace = replace(
        trace,
        streamed_at=batch.streamed_at,
        pumped_at=sunk_at if received_at is None else received_at,
        sunk_at=sunk_at,
    )
    return replace(event, first_token_trace=trace)
