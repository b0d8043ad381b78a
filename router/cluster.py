"""The cluster: Ray actors for the pools, routing, the gateway's output streams, failover.

Life of a request through ``Cluster``:
  generate() -> routed (policy over live load reports) -> submitted to a prefill actor (or a
  decode actor in colocated mode) -> token events stream back from the workers' per-gateway
  output streams, one batch per engine step -> the tracker orders and de-duplicates them ->
  the client's async iterator. A worker that stops answering load reports is taken out of
  rotation; its requests are re-routed (nothing generated yet) or resumed on a live decode
  worker after the tokens the client already has, so every token arrives exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from engine.messages import GenerateRequest, OutputBatch, RequestFailure, TokenEvent, WorkerLoad
from engine.sampling.params import SamplingParams
from router.cluster_config import ClusterConfig
from router.cpu_binding import bind_this_process, plan_cpu_binding, threads_per_worker
from router.load_ledger import LoadLedger
from router.local_prefill import LOCAL_PREFILL_REASONS
from router.policies import NoWorkerError, RoutingInfo, make_policy
from router.ray_capacity import cpus_shortfall, gpus_shortfall, resources_shortfall
from router.request_tracker import ClientItem, RequestTracker
from router.worker_replacement import WorkerReplacement, decode_handles
from router.worker_slots import CALL_TIMEOUT_S, WorkerLauncher, WorkerSlot, plan_slots

logger = logging.getLogger(__name__)
# Requests being placed at once: each waits in a thread until its worker accepts it, which a
# worker does between engine steps (up to a few hundred ms on CPU). asyncio's default executor
# has os.cpu_count() + 4 threads, 6 on a 2-core node, so bursts queued behind each other there.
_MAX_PLACEMENTS_IN_FLIGHT = 64
_PLACEMENT_SEPARATOR = "#"  # a later placement's id: request id, separator, placement number


class RequestFailedError(RuntimeError):
    """The cluster could not complete a request; the message says why."""


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    role: str  # "prefill" | "decode"
    actor: Any  # the Ray actor handle
    ledger: LoadLedger = field(default_factory=LoadLedger)  # latest report + routed since
    last_report: float = 0.0  # monotonic time of the latest report
    alive: bool = True  # in rotation
    # out of rotation because it stopped answering (its process may live on): each load poll
    # asks again, and an answer puts it back in rotation
    stalled: bool = False
    probe: Any = None  # the load call a stalled worker has not answered yet (one at a time)
    probe_roster: int = 0  # a prefill worker's probe: the decode roster version it carried
    slot: str = ""  # its slot in the pool (router.worker_slots); "": its worker id
    replaced: bool = False  # its process is gone and a new worker took its slot

    @property
    def load(self) -> WorkerLoad | None:
        return self.ledger.load


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A snapshot of one worker as the router sees it (for health checks and metrics)."""

    worker_id: str
    role: str  # "prefill" | "decode" (a colocated worker reports "decode")
    alive: bool  # still in rotation
    load: WorkerLoad | None  # latest load report, None before the first


@dataclass(frozen=True, slots=True)
class SlotRestarts:
    """How many workers were started in one slot of a pool after its first one died."""

    slot: str  # "decode-0"
    role: str  # "prefill" | "decode"
    restarts: int  # starts of a new worker, joined or not


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        workers: Sequence[WorkerHandle],
        launcher: WorkerLauncher | None = None,
        slots: Sequence[WorkerSlot] = (),
    ) -> None:
        """``launcher`` starts a worker in the slot of one whose process died (None: never);
        ``slots`` are the workers' (default: a slot named after each, bound to no cores)."""
        self.config = config
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:8]}"
        for worker in workers:
            worker.slot = worker.slot or worker.worker_id
        # Replaced, never changed in place, when a worker joins: threads iterate it unlocked.
        self.workers = {w.worker_id: w for w in workers}
        self._slots = {w.slot: WorkerSlot(w.slot, w.role) for w in workers}
        self._slots.update((slot.name, slot) for slot in slots)
        # Held while a worker joins the pools and while a stalled prefill worker is taken back,
        # so that every prefill worker in rotation knows every decode worker
        # (``WorkerReplacement._join``); taken before ``_lock``, never while holding it.
        self._membership = threading.Lock()
        self._decode_roster = 0  # version of the decode workers' list: +1 when one joins
        self.policy = make_policy(config.router_policy, config.block_size)
        self._trackers: dict[str, RequestTracker] = {}  # by request id
        self._placed: dict[str, RequestTracker] = {}  # by placement id (what workers know)
        self._local_prefills: Counter[str] = Counter()  # reason -> prompts (LocalPrefillRule)
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._placements = ThreadPoolExecutor(
            _MAX_PLACEMENTS_IN_FLIGHT, thread_name_prefix="placement"
        )
        self._replacement = WorkerReplacement(
            launcher,
            self._slots,
            max_restarts=config.max_worker_restarts,
            first_delay_s=config.restart_delay_s,
            workers=lambda: self.workers,
            admit=self._admit,
            start_pump=self._start_pump,
            on_worker_dead=self._on_worker_dead,
            spawn=self._spawn,
            lock=self._lock,
            membership=self._membership,
            stopping=self._stopping,
        )

    # ---- start and stop -----------------------------------------------------------------
    @classmethod
    def start(cls, config: ClusterConfig) -> Cluster:
        """Start (or join, with ``address``) Ray, place the worker actors, wait until ready."""
        binding = None
        if config.bind_worker_cpus:
            num_workers = config.num_prefill + config.num_decode
            threads = threads_per_worker(config.worker_num_cpus)
            binding = plan_cpu_binding(os.sched_getaffinity(0), num_workers, threads)
        if not ray.is_initialized():
            _unnice_local_workers()
            if binding is not None:  # before Ray starts: its processes inherit the binding
                bind_this_process(binding.other_cpus)
            ray.init(address=config.address, ignore_reinit_error=True, log_to_driver=False)
        if config.address is None:  # a joined cluster may still grow: Ray waits for it
            resources = ray.cluster_resources()
            num_workers = config.num_prefill + config.num_decode
            shortfall = (
                cpus_shortfall(num_workers, config.worker_num_cpus, float(resources.get("CPU", 0)))
                or gpus_shortfall(
                    num_workers, config.worker_num_gpus, float(resources.get("GPU", 0))
                )
                or resources_shortfall(config, resources)
            )
            if shortfall is not None:
                raise ValueError(shortfall)
        launcher = WorkerLauncher(config)
        slots = plan_slots(config, binding)
        decode_handles: dict[str, Any] = {}
        workers = []
        for slot in slots:  # decode workers first: the prefill ones are given their handles
            actor = launcher.launch(slot, slot.name, decode_handles)
            if slot.role == "decode":
                decode_handles[slot.name] = actor
            workers.append(WorkerHandle(slot.name, slot.role, actor, slot=slot.name))
        ray.get([w.actor.ready.remote() for w in workers])
        workers.sort(key=lambda w: w.role != "prefill")  # listed prefill first
        cluster = cls(config, workers, launcher, slots)
        cluster._start_threads()
        cluster._poll_loads()
        return cluster

    def shutdown(self) -> None:
        self._stopping.set()
        with self._membership:  # a worker joining now joins first, and is stopped here too
            workers = list(self.workers.values())
        for worker in workers:
            if worker.alive:
                with contextlib.suppress(Exception):  # already gone
                    ray.get(worker.actor.shutdown.remote(), timeout=10)
                ray.kill(worker.actor)
        for thread in self._threads:
            thread.join(timeout=5)
        self._placements.shutdown(wait=False, cancel_futures=True)

    # ---- requests -----------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Token events of every sample, in order per sample, each exactly once.

        ``priority`` orders the request on its workers under ``scheduling_policy`` "priority"
        (lower first, then arrival; kept when it is resumed elsewhere); "fcfs" takes only 0.
        Raises ValueError for an invalid request and RequestFailedError when the cluster
        cannot complete it. Leaving the iterator early aborts the request everywhere.
        """
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[ClientItem] = asyncio.Queue()
        request = GenerateRequest(
            request_id or uuid.uuid4().hex,
            list(prompt_token_ids),
            params,
            self.gateway_id,
            cache_salt,
            priority=priority,
        )

        def sink(item: ClientItem) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        # Routing makes blocking Ray calls: keep them off the event loop that serves clients.
        submitted = loop.run_in_executor(self._placements, self.submit, request, sink)
        try:
            tracker = await asyncio.shield(submitted)
        except asyncio.CancelledError:  # the client left while routing: abort once it is placed

            def abort_once_placed(done: asyncio.Future[RequestTracker]) -> None:
                if not done.cancelled() and done.exception() is None:  # (cancelled: shut down)
                    self.abort(request.request_id)

            submitted.add_done_callback(abort_once_placed)
            raise
        try:
            while True:
                item = await items.get()
                if isinstance(item, TokenEvent):
                    yield item
                elif isinstance(item, RequestFailure):
                    raise RequestFailedError(item.message)
                else:
                    return
        finally:
            if not tracker.closed:
                self.abort(request.request_id)

    def submit(
        self, request: GenerateRequest, sink: Callable[[ClientItem], None]
    ) -> RequestTracker:
        """Route and submit a request; its events go to ``sink`` (from other threads)."""
        with self._lock:
            if request.request_id in self._trackers or request.request_id in self._placed:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            tracker = RequestTracker(request, sink, None, "")
            self._trackers[request.request_id] = tracker
        try:
            self._place(tracker, request)
        except BaseException:
            with self._lock:
                self._forget(tracker)
            raise
        return tracker

    def abort(self, request_id: str) -> None:
        with self._lock:
            tracker = self._trackers.get(request_id)
            if tracker is not None:
                self._end(tracker)

    def _forget(self, tracker: RequestTracker) -> None:
        """Stop tracking a request that ended (lock held): late events about it are dropped."""
        if self._trackers.get(tracker.request_id) is tracker:
            del self._trackers[tracker.request_id]
        for placement_id in tracker.placement_ids:
            if self._placed.get(placement_id) is tracker:
                del self._placed[placement_id]

    def worker_statuses(self) -> list[WorkerStatus]:
        """The workers in the pools: in rotation or not, leaving out those whose slot has a
        newer worker."""
        with self._lock:
            return [
                WorkerStatus(w.worker_id, w.role, w.alive, w.load)
                for w in self.workers.values()
                if not w.replaced
            ]

    def worker_restarts(self) -> list[SlotRestarts]:
        """Each slot's restarts so far (``--max-worker-restarts`` bounds them)."""
        with self._lock:
            return [SlotRestarts(s.name, s.role, s.restarts) for s in self._slots.values()]

    def local_prefills(self) -> dict[str, int]:
        """Prompts routed to be prefilled on their decode worker so far, by reason."""
        with self._lock:
            return {reason: self._local_prefills[reason] for reason in LOCAL_PREFILL_REASONS}

    def is_ready(self) -> bool:
        """At least one live worker can prefill and one can decode (a colocated one does both)."""
        alive_roles = {s.role for s in self.worker_statuses() if s.alive}
        can_prefill = "prefill" in alive_roles or (
            self.config.colocated and "decode" in alive_roles
        )
        return can_prefill and "decode" in alive_roles

    def live_loads(self, role: str) -> list[WorkerLoad]:
        with self._lock:
            return [
                w.load
                for w in self.workers.values()
                if w.role == role and w.alive and w.load is not None
            ]

    # ---- routing ------------------------------------------------------------------------
    def _place(self, tracker: RequestTracker, request: GenerateRequest) -> None:
        """Pick workers for a (re)submitted request and send it there.

        The lock is taken to choose and to record, not while the worker accepts: a worker
        takes a request between two engine steps, and holding the lock meanwhile would stall
        every other request's tokens for up to a step. While ``tracker.placing``, tokens from
        the workers being asked are accepted, their failure reports are held, and a worker's
        death does not see the request; so once the worker has accepted, the choice is checked
        again against deaths meanwhile. (A re-route after a failure runs with the lock held by
        its caller; it is rare.)

        A chosen worker found dead on submission is taken out of rotation (its other requests
        recovered) and the choice is made again among the live ones. Each try is a placement
        of its own (``_new_placement``): a live worker that accepted a placement given up (the
        other chosen worker died meanwhile) is told to drop that one.
        """
        tracker.placing = True
        given_up: list[tuple[str, str]] = []  # (worker, placement id): accepted, given up
        try:
            for _ in range(len(self.workers)):
                prefill_id, decode_id, local = self._choose(request)
                with self._lock:
                    placement_id = self._new_placement(tracker)
                    tracker.candidates = tuple(w for w in (prefill_id, decode_id) if w)
                target = self.workers[prefill_id or decode_id]
                placed = replace(request, request_id=placement_id)
                try:
                    if prefill_id is None:
                        ref = target.actor.submit.remote(placed)
                    else:
                        ref = target.actor.submit.remote(placed, decode_id)
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                except ray.exceptions.RayActorError:
                    self._on_worker_dead(target, skip=tracker)
                    continue
                except ray.exceptions.GetTimeoutError:
                    self._on_worker_dead(target, skip=tracker, stalled=True)
                    target.actor.abort.remote(placement_id)  # it may take it when it wakes
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

    def _new_placement(self, tracker: RequestTracker) -> str:
        """A fresh placement id for the request, the one its workers will know it by (lock
        held): the request id for the first placement, then ``<request id>#<n>``, never an id
        in use. Reports about an earlier placement are stale from now on."""
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

    def _choose(self, request: GenerateRequest) -> tuple[str | None, str, str | None]:
        """(prefill worker, decode worker, why the decode worker prefills it) for the request,
        among the live ones; no prefill worker when the decode worker prefills it (colocated,
        resumed, or a local prefill: the reason). The choice counts towards their load at once,
        so requests routed meanwhile see it."""
        info = RoutingInfo(request.request_id, request.prompt_token_ids, request.cache_salt)
        with self._lock:
            try:
                decode_id = self.policy.choose_decode(info, self.live_loads("decode"))
                prefill_id = local = None
                if not self.config.colocated and not request.resume_token_ids:
                    prefill_loads = self.live_loads("prefill")
                    local = self.config.local_prefill.reason(
                        len(request.prompt_token_ids), prefill_loads, self.workers[decode_id].load
                    )
                    if local is None:
                        prefill_id = self.policy.choose_prefill(info, prefill_loads)
            except NoWorkerError as error:
                raise RequestFailedError(str(error)) from error
            self._charge_routed(prefill_id, decode_id, request)
        return prefill_id, decode_id, local

    def _record_placement(
        self, tracker: RequestTracker, prefill_id: str | None, decode_id: str, local: str | None
    ) -> bool:
        """Note where an accepted request runs; False if a chosen worker died meanwhile.

        The worker that accepted it holds it from now on: load reports asked for later show it.
        """
        accepted_at = time.monotonic()
        with self._lock:
            accepting = self.workers[prefill_id or decode_id]
            accepting.ledger.mark_held(tracker.request_id, accepted_at)
            if not all(self.workers[w].alive for w in (prefill_id, decode_id) if w is not None):
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
                self._on_failure(*held)
        return True

    def _abort_on(self, worker_ids: set[str], placement_id: str) -> None:
        """Tell the live ones of ``worker_ids`` to drop a placement (not waiting for them)."""
        for worker_id in sorted(worker_ids):
            worker = self.workers[worker_id]
            if worker.alive:
                worker.actor.abort.remote(placement_id)

    def _charge_routed(
        self, prefill_id: str | None, decode_id: str, request: GenerateRequest
    ) -> None:
        """Count a routed request towards its workers' load (any earlier routing of it no
        longer counts) until their reports show it."""
        for worker in self.workers.values():
            worker.ledger.drop(request.request_id)
        request_id, num_prompt_tokens = request.request_id, len(request.prompt_token_ids)
        decode = self.workers[decode_id].ledger
        if prefill_id is None:  # the decode worker prefills the prompt itself
            decode.charge(
                request_id, num_sequences=request.params.n, num_prompt_tokens=num_prompt_tokens
            )
        else:
            self.workers[prefill_id].ledger.charge(request_id, num_prompt_tokens=num_prompt_tokens)
            decode.charge(request_id, num_sequences=request.params.n)

    # ---- outputs ------------------------------------------------------------------------
    def _start_threads(self) -> None:
        for worker in self.workers.values():
            self._start_pump(worker)
        self._spawn(self._monitor, name="load-monitor")

    def _spawn(self, target: Callable[..., None], *args: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _start_pump(self, worker: WorkerHandle) -> None:
        self._spawn(self._pump, worker, name=f"pump-{worker.worker_id}")

    def _pump(self, worker: WorkerHandle) -> None:
        """Carry one worker's output stream for this gateway into the request trackers."""
        stream = worker.actor.stream.options(num_returns="streaming").remote(self.gateway_id)
        try:
            for ref in stream:
                if self._stopping.is_set():
                    return
                batch = ray.get(ref)
                try:
                    self._dispatch(batch)
                except Exception:  # a bug: the other requests' tokens keep flowing
                    logger.exception("dispatching a batch of %s failed", worker.worker_id)
        except Exception:  # the worker died: the monitor takes it out of rotation
            logger.info("output stream of %s ended", worker.worker_id)

    def _dispatch(self, batch: OutputBatch) -> None:
        with self._lock:
            for event in batch.events:
                tracker = self._placed.get(event.request_id)
                if tracker is None or not tracker.sent_by_its_workers(
                    batch.worker_id, event.request_id
                ):
                    continue  # finished, or from a placement given up
                if event.position == 0 and event.sample_index == 0:
                    self._first_token_out(tracker.request_id)
                try:
                    tracker.accept(event)
                except Exception:  # its client cannot be reached (its event loop closed):
                    # nobody reads it, and the batch's other requests go on
                    logger.exception("client of %s unreachable; aborting it", tracker.request_id)
                    self._end(tracker)
                    continue
                if tracker.prefill_worker is not None and tracker.started_decoding:
                    tracker.prefill_worker = None  # first tokens out, decoding begun: prefill over
                if tracker.closed:
                    self._forget(tracker)
            for failure in batch.failures:
                self._on_failure(failure, batch.worker_id)

    def _first_token_out(self, request_id: str) -> None:
        """A prefill is done: its decode worker holds the request from here on (the KV
        hand-off leaves with the first token; in colocated mode it held it already)."""
        now = time.monotonic()
        for worker in self.workers.values():
            worker.ledger.mark_held(request_id, now)

    def _on_failure(self, failure: RequestFailure, worker_id: str) -> None:
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
            if self._continues_on_decode_worker(tracker):
                return
            if self._trackers.get(tracker.request_id) is not tracker:
                return  # its decode worker was found dead, and that recovered it
            if tracker.num_retries < self.config.max_retries:
                self._resume(tracker)
                return
        self._fail(tracker, failure.message)

    def _fail(self, tracker: RequestTracker, message: str) -> None:
        """End a request for good: the client gets ``message``, its live workers drop it."""
        self._end(tracker, message)

    def _end(self, tracker: RequestTracker, failure: str | None = None) -> None:
        """Stop a request (lock held): untracked, its client sent ``failure`` (None: it left or
        aborted, nothing is sent), and its live workers told to drop its placement."""
        self._forget(tracker)
        if failure is None:
            tracker.closed = True
        else:
            tracker.fail(failure)
        self._abort_on(tracker.workers, tracker.placement_id)

    def _continues_on_decode_worker(self, tracker: RequestTracker) -> bool:
        """Whether the request's decode worker holds it (a failure report came too late)."""
        decode = self.workers.get(tracker.decode_worker)
        if decode is None or not decode.alive:
            return False
        try:
            ref = decode.actor.has_request.remote(tracker.placement_id)
            return bool(ray.get(ref, timeout=CALL_TIMEOUT_S))
        except ray.exceptions.RayActorError:
            self._on_worker_dead(decode, skip=tracker)
        except ray.exceptions.GetTimeoutError:
            self._on_worker_dead(decode, skip=tracker, stalled=True)
        return False

    # ---- health -------------------------------------------------------------------------
    def _monitor(self) -> None:
        while not self._stopping.wait(self.config.report_interval_s):
            try:
                self._poll_loads()
            except Exception:  # a bug: keep watching the workers all the same
                logger.exception("polling the workers' loads failed")

    def _poll_loads(self) -> None:
        live = [w for w in self.workers.values() if w.alive]
        now = time.monotonic()
        refs = {w.worker_id: w.actor.load.remote() for w in live}
        answer_by = now + self.config.dead_after_s  # one wait for all: hung ones do not add up
        for worker in live:
            try:
                remaining_s = max(0.0, answer_by - time.monotonic())
                load = ray.get(refs[worker.worker_id], timeout=remaining_s)
            except ray.exceptions.RayActorError:
                self._on_worker_dead(worker)
                continue
            except ray.exceptions.GetTimeoutError:
                # silent for dead_after_s by the end of this wait (measured from the round's
                # start, a stall was found only in the round after, at twice dead_after_s)
                if time.monotonic() - worker.last_report >= self.config.dead_after_s:
                    self._on_worker_dead(worker, stalled=True)
                continue
            with self._lock:
                worker.ledger.record(load, now, self._trackers.__contains__)
                worker.last_report = time.monotonic()
        self._probe_stalled()

    def _probe_stalled(self) -> None:
        """Put back in rotation a worker that stopped answering and answers again (a long GC
        pause, swapping, a stopped process continued). Its requests were re-routed and it was
        told to drop them when it went out, so it comes back empty-handed as far as the router
        knows. Never waits: a probe not answered yet is looked at again next round."""
        for worker in [w for w in self.workers.values() if w.stalled]:
            if worker.probe is None:
                worker.probe = self._probe(worker)
            requested_at = time.monotonic()
            try:
                load = ray.get(worker.probe, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError:  # its process is gone after all: out for good
                worker.stalled, worker.probe = False, None
                self._replacement.on_process_gone(worker)
                continue
            except ray.exceptions.RayError:  # the call failed (not the worker): ask again
                worker.probe = None
                continue
            if not self._take_back(worker, load, requested_at):
                worker.probe = None  # decode workers joined since it was asked: ask again
                continue
            logger.warning(
                "%s worker %s answers again; back in rotation", worker.role, worker.worker_id
            )

    def _probe(self, worker: WorkerHandle) -> Any:
        """Ask a stalled worker for its load; a prefill worker is also given the decode
        workers, so that it knows those that joined while it was out."""
        if worker.role == "decode":
            return worker.actor.load.remote()
        worker.probe_roster = self._decode_roster
        return worker.actor.rejoin.remote(decode_handles(self.workers.values()))

    def _take_back(self, worker: WorkerHandle, load: WorkerLoad, requested_at: float) -> bool:
        """Put a stalled worker that answered back in rotation; False (it stays out) for a
        prefill worker whose probe predates a decode worker's joining, or while one joins."""
        if not self._membership.acquire(blocking=False):
            return False
        try:
            if worker.role == "prefill" and worker.probe_roster != self._decode_roster:
                return False
            with self._lock:
                worker.probe = None
                worker.ledger.record(load, requested_at, self._trackers.__contains__)
                worker.last_report = time.monotonic()
                worker.stalled, worker.alive = False, True
            return True
        finally:
            self._membership.release()

    def _admit(self, worker: WorkerHandle, load: WorkerLoad, asked_at: float) -> None:
        """Put a worker started in a slot in rotation, with its first load, asked for at
        ``asked_at`` (lock held, under ``_membership``); the slot's earlier workers whose
        process is gone count as replaced."""
        worker.ledger.record(load, asked_at, self._trackers.__contains__)
        worker.last_report = time.monotonic()
        for earlier in self.workers.values():  # a stalled one may still come back
            if earlier.slot == worker.slot and not (earlier.alive or earlier.stalled):
                earlier.replaced = True
        self.workers = {**self.workers, worker.worker_id: worker}
        if worker.role == "decode":
            self._decode_roster += 1

    def _on_worker_dead(
        self, worker: WorkerHandle, skip: RequestTracker | None = None, *, stalled: bool = False
    ) -> None:
        """Take a worker out of rotation and recover its requests elsewhere. A ``stalled`` one
        (it stopped answering; its process may live on) is told to drop them."""
        with self._lock:
            if not worker.alive:
                return
            logger.warning(
                "%s worker %s is gone; re-routing its requests", worker.role, worker.worker_id
            )
            worker.alive = False
            worker.stalled = stalled
            worker.ledger.drop_all()  # its reports stopped: nothing else would drop them
            if not stalled:
                self._replacement.on_process_gone(worker)
            affected = [
                t
                for t in self._trackers.values()
                if worker.worker_id in (t.prefill_worker, t.decode_worker) and t is not skip
            ]
            for tracker in affected:
                if stalled:
                    worker.actor.abort.remote(tracker.placement_id)
                # a death found while recovering an earlier one may have recovered it already
                if self._still_placed_on(tracker, worker):
                    self._recover(tracker, worker)

    def _still_placed_on(self, tracker: RequestTracker, worker: WorkerHandle) -> bool:
        """The request is still tracked and still placed on ``worker``."""
        placed_on = worker.worker_id in (tracker.prefill_worker, tracker.decode_worker)
        return placed_on and self._trackers.get(tracker.request_id) is tracker

    def _recover(self, tracker: RequestTracker, dead: WorkerHandle) -> None:
        if dead.role == "prefill" and tracker.has_delivered:
            # The first token left: the decode worker may hold the request already (and
            # recomputes it if its KV never comes). If it does not, resume it there.
            if self._continues_on_decode_worker(tracker):
                tracker.prefill_worker = None
                return
            if self._trackers.get(tracker.request_id) is not tracker:
                return  # its decode worker was found dead too, and that recovered it
        elif dead.role == "decode" and not tracker.has_delivered and self._retarget(tracker):
            return
        if tracker.num_retries >= self.config.max_retries:
            self._fail(tracker, f"{dead.role} worker {dead.worker_id} failed; retries exhausted")
            return
        self._resume(tracker)

    def _retarget(self, tracker: RequestTracker) -> bool:
        """Point a request still prefilling at another live decode worker; False if none
        can take it or the prefill worker has handed it off already."""
        prefill = self.workers.get(tracker.prefill_worker or "")
        if prefill is None or not prefill.alive:
            return False
        info = RoutingInfo(tracker.request_id, tracker.request.prompt_token_ids)
        try:
            decode_id = self.policy.choose_decode(info, self.live_loads("decode"))
        except NoWorkerError:
            return False
        ref = prefill.actor.retarget.remote(tracker.placement_id, decode_id)
        with contextlib.suppress(ray.exceptions.RayError):
            if ray.get(ref, timeout=CALL_TIMEOUT_S):
                tracker.decode_worker = decode_id
                self.workers[decode_id].ledger.charge(
                    tracker.request_id, num_sequences=tracker.request.params.n
                )
                return True
        return False

    def _resume(self, tracker: RequestTracker) -> None:
        """Submit the request again, continuing after the tokens the client already has. The
        placement given up sends nothing more to the client, and its live workers drop it: a
        decode worker may still admit its copy (a hand-off that failed late, or whose prefill
        worker died before its first token got out), and that copy would run unseen."""
        self._abort_on(tracker.workers, tracker.placement_id)
        tracker.num_retries += 1
        tracker.prefill_worker, tracker.decode_worker = None, ""
        try:
            self._place(tracker, tracker.resume_request())
        except (RequestFailedError, ValueError, ray.exceptions.RayError) as error:
            self._fail(tracker, f"could not re-route the request: {error}")


def _unnice_local_workers() -> None:
    """Worker processes of a Ray this process starts run at niceness 0, unless the operator
    set ``RAY_worker_niceness`` (a running cluster keeps its own: deploy/ sets it on its nodes).

    Ray starts workers at niceness 15 so that busy tasks leave its driver and raylet room, but
    our workers run the engines, the critical path: on a CPU node shared with the gateway, a
    niced engine lost its core to it (5 ms decode steps stretched to 200 ms; goodput at 24
    req/s on the demo model 13.3 -> 16.2 req/s, mean of 9 runs each).
    """
    os.environ.setdefault("RAY_worker_niceness", "0")
