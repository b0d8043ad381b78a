"""The worker pools: each worker's handle, slot, health and load, and a new worker started in
the slot of one whose process is gone.

A worker's health, as the load poll sees it (slow is not dead):
  prompt  -- its latest load report is at most ``late_after_s`` old, and its engine finished a
             step (or a wait for work) within ``late_after_s`` of it: routed to first
  late    -- not prompt: routed to only when its role has no prompt worker
  stalled -- silent for ``dead_after_s``, or its engine stuck in one step that long, while its
             process may live on: out of rotation, its requests recovered elsewhere; probed
             every round, and back in rotation once it answers with its engine moving
  gone    -- its process is gone (Ray says so): out for good; a new worker starts in its slot
  draining -- changing role (router/rebalancer.py): in rotation for what it holds, routed
             nothing new; then retired (out, stopped, its slot closed, no replacement)
The pool finds deaths and reports them (``PoolChanges``); recovering the requests that were
on a worker is the placements' job (``router.placements``), never the pool's.

Locks, in the one order they are taken: ``Placements._lock`` -> ``WorkerPool._membership`` ->
``WorkerPool._lock``. The pool never calls into the placements. A method whose name ends in
``_locked`` expects its caller to hold ``_lock``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import ray

from engine.messages import GenerateRequest, KVCursor, KVEventsReply, WorkerLoad
from router.cluster_config import ClusterConfig
from router.kv_index import KVIndex
from router.latency_model import LatencyModel
from router.load_ledger import LoadLedger, charge_routed
from router.worker_host import RoleChange
from router.worker_shutdown import join_threads, stop_actors
from router.worker_slots import CALL_TIMEOUT_S, WorkerLauncher, WorkerSlot

logger = logging.getLogger("router.cluster")
_ANSWER_WAIT_S = 0.1  # how long a poll waits for the load calls it sent, all together
Role = Literal["prefill", "decode"]


@dataclass(slots=True)
class WorkerHandle:
    """One worker as the pool knows it; its fields change only through ``WorkerPool``."""

    worker_id: str
    role: str  # "prefill" | "decode"
    actor: Any  # the Ray actor handle
    ledger: LoadLedger = field(default_factory=LoadLedger)  # latest report + routed since
    # monotonic time of the latest report (at first: when the handle was made, so a worker
    # is silent from then on until it answers)
    last_report: float = field(default_factory=time.monotonic)
    alive: bool = True  # in rotation
    # out of rotation because it stopped answering (its process may live on): each poll looks
    # at its probe, and an answer puts it back in rotation
    stalled: bool = False
    load_call: Any = None  # the load call sent and not answered yet (one at a time)
    load_asked_at: float = 0.0  # monotonic time ``load_call`` was sent
    report_asked_at: float = float("-inf")  # monotonic time the latest report was asked for
    probe: Any = None  # the load call a stalled worker has not answered yet (one at a time)
    probe_roster: int = 0  # a prefill worker's probe: the decode roster version it carried
    slot: str = ""  # its slot in the pool (router.worker_slots); "": its worker id
    replaced: bool = False  # its process is gone and a new worker took its slot
    draining: bool = False  # routed nothing new: it is leaving its role (then retired)
    retired: bool = False  # stopped for good by the rebalancer (never replaced)

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


@dataclass(frozen=True, slots=True)
class PoolChanges:
    """What one poll found, for the cluster to act on."""

    lost: list[WorkerHandle]  # taken out of rotation: their requests are to be recovered
    joined: list[WorkerHandle]  # started in a slot and in rotation: their outputs to be read


class WorkerPool:
    def __init__(
        self,
        config: ClusterConfig,
        workers: Iterable[WorkerHandle],
        launcher: WorkerLauncher | None = None,  # None: a dead worker's slot stays empty
        slots: Iterable[WorkerSlot] = (),  # default: a slot named after each, bound to no cores
    ) -> None:
        self.config = config
        workers = list(workers)
        for worker in workers:
            worker.slot = worker.slot or worker.worker_id
        # Replaced, never changed in place, when a worker joins: threads iterate it unlocked.
        self.workers: dict[str, WorkerHandle] = {w.worker_id: w for w in workers}
        self._slots = {w.slot: WorkerSlot(w.slot, w.role) for w in workers}
        self._slots.update((slot.name, slot) for slot in slots)
        self._launcher = launcher
        # what each worker's prefix cache holds, from the KV events its load reports carry;
        # kept for the kv_aware policy only (None: the reports carry no events)
        self.kv_index = KVIndex() if config.router_policy == "kv_aware" else None
        # each worker's step times and the hand-offs', fitted from the timings its reports carry
        self.latency_model = LatencyModel()
        # Held while a worker joins and while a stalled prefill worker is taken back, so that
        # every prefill worker in rotation knows every decode worker (``_join``).
        self._membership = threading.Lock()
        self._lock = threading.RLock()  # the workers' health and ledgers, the slots
        self._decode_roster = 0  # version of the decode workers' list: +1 when one joins
        self._lost: list[WorkerHandle] = []  # taken out by the pool's own threads, not reported
        self._joined: list[WorkerHandle] = []  # joined, not reported yet
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- routing's view -----------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerHandle:
        return self.workers[worker_id]

    def routable_loads(self, role: str) -> list[WorkerLoad]:
        """The loads routing chooses among: the prompt workers of ``role``, or its late ones
        when none is prompt (slow is not dead: a late worker is routed to last)."""
        now = time.monotonic()
        with self._lock:
            live = [
                w
                for w in self.workers.values()
                if w.role == role and w.alive and w.load and not w.draining
            ]
            prompt = [w for w in live if self._is_prompt_locked(w, now)]
            return [w.load for w in prompt or live if w.load is not None]

    def every_worker_late(self, role: str) -> bool:
        """``role`` has workers in rotation, and none of them is prompt."""
        now = time.monotonic()
        with self._lock:
            live = [w for w in self.workers.values() if w.role == role and w.alive]
            return bool(live) and not any(self._is_prompt_locked(w, now) for w in live)

    def _is_prompt_locked(self, worker: WorkerHandle, now: float) -> bool:
        """Its report is recent and shows its engine moving (see the module's docstring)."""
        report = worker.ledger.report
        if report is None or now - worker.last_report > self.config.late_after_s:
            return False
        return report.seconds_since_progress <= self.config.late_after_s

    def load_of(self, worker_id: str) -> WorkerLoad | None:
        """A worker's load as routing counts it (its report plus the requests routed since)."""
        with self._lock:
            return self.workers[worker_id].load

    def reported_since(self, asked_after: float) -> bool:
        """Every worker in rotation has reported, in a report asked for at ``asked_after`` or
        later."""
        with self._lock:
            return all(
                w.ledger.report is not None and w.report_asked_at >= asked_after
                for w in self.workers.values()
                if w.alive
            )

    def is_alive(self, worker_id: str) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.alive

    # ---- the ledgers ----------------------------------------------------------------------
    def charge_routed(
        self, prefill_id: str | None, decode_id: str, request: GenerateRequest
    ) -> None:
        """Count a routed request towards its workers' load (any earlier routing of it no
        longer counts) until their reports show it."""
        resumed = sum(len(tokens) for tokens in request.resume_token_ids.values())
        self.charge(
            request.request_id,
            prefill_id,
            decode_id,
            len(request.prompt_token_ids),
            request.params.n,
            resumed,
        )

    def charge(
        self,
        request_id: str,
        prefill_id: str | None,
        decode_id: str,
        num_prompt_tokens: int,
        num_sequences: int,
        num_resumed_tokens: int = 0,
    ) -> None:
        """Count a request towards the workers it is (or is to be) placed on, replacing any
        earlier charge of it: its prompt queued on the prefill worker (None: on the decode
        worker), its sequences running on the decode worker, each reading the prompt's KV."""
        with self._lock:
            if any(w not in self.workers for w in (prefill_id, decode_id) if w is not None):
                return  # (a worker that left meanwhile: nothing to count it towards)
            for worker in self.workers.values():
                worker.ledger.drop(request_id)
            charge_routed(
                request_id,
                None if prefill_id is None else self.workers[prefill_id].ledger,
                self.workers[decode_id].ledger,
                num_prompt_tokens,
                num_sequences,
                num_resumed_tokens,
            )

    def charge_decode(self, decode_id: str, request_id: str, num_sequences: int) -> None:
        """Count a request pointed at another decode worker towards it."""
        with self._lock:
            self.workers[decode_id].ledger.charge(request_id, num_sequences=num_sequences)

    def drop_charges(self, request_id: str) -> None:
        """A request ended: it no longer counts towards any worker's load (no report after
        its end would show it, so none need be waited for)."""
        with self._lock:
            for worker in self.workers.values():
                worker.ledger.drop(request_id)

    def mark_held(self, request_id: str, now: float, worker_id: str | None = None) -> None:
        """``worker_id`` (None: every worker) holds the request from ``now`` on: its reports
        asked for later show it."""
        with self._lock:
            for worker in self.workers.values():
                if worker_id is None or worker.worker_id == worker_id:
                    worker.ledger.mark_held(request_id, now)

    # ---- health ---------------------------------------------------------------------------
    def poll(self, is_open: Callable[[str], bool]) -> PoolChanges:
        """One round of the load poll: ask every worker in rotation for its load (one call out
        per worker), wait at most ``_ANSWER_WAIT_S`` for the answers together, record those
        that came, and take out the workers whose process is gone or that were silent for
        ``dead_after_s``; a late answer is looked at next round. ``is_open`` says whether a
        request has not ended yet. Returns the workers taken out by the pool since the last
        round (a round that fails part-way leaves its own for the next) and those that joined.
        """
        calls = {}
        for worker in [w for w in list(self.workers.values()) if w.alive]:
            call = worker.load_call or worker.actor.load.remote(self._kv_cursor(worker))
            with self._lock:
                if not worker.alive:  # taken out meanwhile: its call is dropped
                    continue
                if worker.load_call is None:
                    worker.load_call, worker.load_asked_at = call, time.monotonic()
            calls[worker.worker_id] = (worker, call)
        if calls:  # a prompt worker answers within milliseconds: its report is fresh
            wait_s = min(_ANSWER_WAIT_S, self.config.report_interval_s)
            refs = [call for _, call in calls.values()]
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for worker, call in calls.values():
            self._poll_one(worker, call, is_open)
        with self._lock:
            lost, joined, self._lost, self._joined = self._lost, self._joined, [], []
        return PoolChanges(lost, joined)

    def _poll_one(self, worker: WorkerHandle, call: Any, is_open: Callable[[str], bool]) -> None:
        """Look at the answer to one worker's load ``call``."""
        if not worker.alive:  # taken out meanwhile, by the thread that found it lost
            return
        try:
            load = _answer(call)
        except ray.exceptions.RayActorError:
            self._report_lost(worker, stalled=False)
            return
        except ray.exceptions.RayError:  # the call failed, not the worker: ask again
            worker.load_call = load = None
        if load is None:
            if time.monotonic() - worker.last_report >= self.config.dead_after_s:
                self._report_lost(worker, stalled=True)
            return
        with self._lock:
            if not worker.alive:  # taken out meanwhile: its KV events no longer count
                return
            load = self._take_timings(worker, self._take_kv_events_locked(worker, load))
            worker.ledger.record(load, worker.load_asked_at, is_open)
            worker.last_report, worker.report_asked_at = time.monotonic(), worker.load_asked_at
            worker.load_call = None  # the next round asks again
        if load.seconds_since_progress >= self.config.dead_after_s:  # it answers, its engine
            self._report_lost(worker, stalled=True)  # is stuck: silent all the same

    def follow_kv_events(self, worker_id: str, reply: KVEventsReply) -> None:
        """Apply the KV event batches a worker's output batch carried (the index takes those
        that continue from where it is; a worker out of rotation is not followed)."""
        with self._lock:
            worker = self.workers.get(worker_id)
            if self.kv_index is not None and worker is not None and worker.alive:
                self.kv_index.follow(worker_id, reply)

    def _kv_cursor(self, worker: WorkerHandle) -> KVCursor | None:
        """What to ask a worker's KV events with (None: the index is off)."""
        return None if self.kv_index is None else self.kv_index.cursor(worker.worker_id)

    def _take_timings(self, worker: WorkerHandle, load: WorkerLoad) -> WorkerLoad:
        """Give the step and transfer timings a report carries, and a prefill worker's waits
        for decode workers' blocks, to the latency model; the report without them."""
        if worker.role == "prefill":
            self.latency_model.observe_waiting(worker.worker_id, load.block_waits)
        if not load.step_timings and not load.transfer_timings:
            return load
        self.latency_model.observe(
            worker.worker_id, worker.role, load.step_timings, load.transfer_timings
        )
        return replace(load, step_timings=(), transfer_timings=())

    def _take_kv_events_locked(self, worker: WorkerHandle, load: WorkerLoad) -> WorkerLoad:
        """Apply the KV events a report carries to the index; the report without them."""
        if load.kv_events is None:
            return load
        if self.kv_index is not None:
            self.kv_index.apply(worker.worker_id, load.kv_events)
        return replace(load, kv_events=None)

    def take_out(self, worker: WorkerHandle, *, stalled: bool = False) -> bool:
        """Take a worker out of rotation; True if it was in rotation (the caller recovers its
        requests). A ``stalled`` one (silent; its process may live on) is probed to come back;
        one whose process is gone is replaced in its slot."""
        with self._lock:
            if not worker.alive:
                return False
            logger.warning(
                "%s worker %s is %s; re-routing its requests",
                worker.role,
                worker.worker_id,
                f"silent or stuck for {self.config.dead_after_s:.0f} s" if stalled else "gone",
            )
            worker.alive, worker.stalled = False, stalled
            worker.load_call = None
            worker.ledger.drop_all()  # its reports stopped: nothing else would drop them
            if self.kv_index is not None:  # its blocks are not routed to any more
                self.kv_index.forget(worker.worker_id)
        if not stalled:
            self.latency_model.forget(worker.worker_id)  # (a new worker has an id of its own)
            self._on_process_gone(worker)
        return True

    def probe_stalled(self, is_open: Callable[[str], bool]) -> None:
        """Put back in rotation a worker that stopped answering and answers again (a long GC
        pause, swapping, a stopped process continued). Its requests were recovered and it was
        told to drop them when it went out, so it comes back empty-handed as far as the router
        knows."""
        for worker in [w for w in self.workers.values() if w.stalled]:
            if worker.probe is None:
                worker.probe = self._probe(worker)
            requested_at = time.monotonic()
            try:
                load = _answer(worker.probe)
            except ray.exceptions.RayActorError:  # its process is gone after all: out for good
                worker.stalled, worker.probe = False, None
                self._on_process_gone(worker)
                continue
            except ray.exceptions.RayError:  # the call failed (not the worker): ask again
                worker.probe = None
                continue
            if load is None:
                continue
            if not self._take_back(worker, load, requested_at, is_open):
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
        return worker.actor.rejoin.remote(self.decode_handles())

    def _take_back(
        self,
        worker: WorkerHandle,
        load: WorkerLoad,
        requested_at: float,
        is_open: Callable[[str], bool],
    ) -> bool:
        """Put a stalled worker that answered back in rotation; False (it stays out) for a
        prefill worker whose probe predates a decode worker's joining, or while one joins."""
        if not self._membership.acquire(blocking=False):
            return False
        try:
            if worker.role == "prefill" and worker.probe_roster != self._decode_roster:
                return False
            if load.seconds_since_progress > self.config.late_after_s:
                return False  # it answers, but its engine is not moving yet
            with self._lock:
                worker.probe = worker.load_call = None
                worker.ledger.record(self._take_timings(worker, load), requested_at, is_open)
                worker.last_report, worker.report_asked_at = time.monotonic(), requested_at
                worker.stalled, worker.alive = False, True
            return True
        finally:
            self._membership.release()

    def decode_handles(self) -> dict[str, Any]:
        """The decode workers a prefill worker may be pointed at, by id: in rotation, or
        stalled (they may come back)."""
        return {
            w.worker_id: w.actor
            for w in self.workers.values()
            if w.role == "decode" and (w.alive or w.stalled)
        }

    # ---- statuses ---------------------------------------------------------------------------
    def statuses(self) -> list[WorkerStatus]:
        """The workers in the pools: in rotation or not, leaving out those whose slot has a
        newer worker and those retired."""
        with self._lock:
            return [
                WorkerStatus(w.worker_id, w.role, w.alive, w.load)
                for w in self.workers.values()
                if not (w.replaced or w.retired)
            ]

    def restarts(self) -> list[SlotRestarts]:
        """Each slot's restarts so far (``--max-worker-restarts`` bounds them)."""
        with self._lock:
            return [SlotRestarts(s.name, s.role, s.restarts) for s in self._slots.values()]

    # ---- changing a worker's role (router/rebalancer.py) --------------------------------
    def start_draining(self, worker_id: str) -> WorkerHandle:
        """Route nothing new to the worker; what it holds runs on."""
        with self._lock:
            worker = self.workers[worker_id]
            worker.draining = True
            return worker

    def retire(self, worker: WorkerHandle, keep_placement: bool = False) -> bool:
        """Take a draining worker out of rotation for good: no new worker starts in its slot,
        and the prefill workers forget it (a decode one). False if it was out already (lost
        meanwhile: the poll recovers its requests). Its actor is stopped by ``stop_retired``,
        once its requests are recovered elsewhere, or changes role (``change_role``): then,
        with ``keep_placement``, its ranks' placement group is kept for it."""
        with self._lock:
            if not worker.alive:
                return False
            worker.alive, worker.retired = False, True
            worker.load_call = None
            worker.ledger.drop_all()
            if self.kv_index is not None:
                self.kv_index.forget(worker.worker_id)
            slot = self._slots.pop(worker.slot, None)
        self.latency_model.forget(worker.worker_id)
        if worker.role == "decode":
            for prefill in list(self.workers.values()):
                if prefill.role == "prefill" and (prefill.alive or prefill.stalled):
                    prefill.actor.forget_decode_peer.remote(worker.worker_id)
        if slot is not None and self._launcher is not None and not keep_placement:
            self._launcher.release(slot.name)
        logger.warning("%s worker %s retired from its pool", worker.role, worker.worker_id)
        return True

    def stop_retired(self, worker: WorkerHandle) -> None:
        stop_actors([worker.actor])

    def start_worker(
        self, role: str, cpus: tuple[int, ...] = (), place_within_s: float | None = None
    ) -> WorkerHandle | None:
        """Start a worker of ``role`` in a new slot of its pool (bound to ``cpus``) and put it
        in rotation; None if it failed to start or join, or if Ray did not place its ranks
        within ``place_within_s`` (None: it waits as long as Ray takes)."""
        slot = self._new_slot(role, cpus)
        worker = self._start_in(slot, place_within_s)
        if worker is not None and self._join(worker, slot):
            return worker
        self._close_slot(slot)
        return None

    @property
    def changes_roles_in_place(self) -> bool:
        """Whether a retired worker's process can take the other role (``change_role``)."""
        return self._launcher is not None and self._launcher.changes_in_place()

    def change_role(
        self,
        retired: WorkerHandle,
        role: str,
        cpus: tuple[int, ...] = (),
        drained: bool = True,
    ) -> WorkerHandle | None:
        """Make a retired worker's process a worker of ``role``, in a new slot of that pool,
        and put it in rotation: its weights stay, its engine is built anew, and its KV cache is
        kept (where it fits) if it ``drained``: every request on it ended, none writes to its
        cache any more (``WorkerActor.change_role``). A tensor-parallel worker's ranks change
        with it, in their placement group (kept by ``retire``), which the new slot takes. None
        if that failed (its processes are stopped then)."""
        assert self._launcher is not None
        slot = self._new_slot(role, cpus)
        self._launcher.move_placement(retired.slot, slot.name)
        worker_id = slot.worker_id(0)
        logger.warning("%s worker %s becomes %s worker %s", retired.role, retired.worker_id,
                       role, worker_id)  # fmt: skip
        spec = self._launcher.spec(role, worker_id, self.decode_handles())
        changed = retired.actor.change_role.remote(spec, drained)
        try:
            while not ray.wait([changed], timeout=1.0)[0]:
                if self.stopping.is_set():
                    raise ray.exceptions.RayError("the cluster is stopping")
            change: RoleChange = ray.get(changed)
        except ray.exceptions.RayError as error:
            logger.error("%s could not become %s: %s", retired.worker_id, worker_id, error)
            _kill(retired.actor)
            self._close_slot(slot)
            return None
        logger.warning("%s is %s worker %s: %s", retired.worker_id, role, worker_id,
                       change.describe())  # fmt: skip
        worker = WorkerHandle(worker_id, role, retired.actor, slot=slot.name)
        if self._join(worker, slot):
            return worker
        self._close_slot(slot)
        return None

    def _close_slot(self, slot: WorkerSlot) -> None:
        """Drop a new slot whose worker did not join (its ranks' placement group given back)."""
        with self._lock:
            self._slots.pop(slot.name, None)
        if self._launcher is not None:
            self._launcher.release(slot.name)

    def _new_slot(self, role: str, cpus: tuple[int, ...]) -> WorkerSlot:
        """A new slot of ``role``'s pool, its worker being started (no replacement meanwhile)."""
        with self._lock:
            taken = {name for name in self._slots} | {w.slot for w in self.workers.values()}
            index = next(i for i in itertools.count() if f"{role}-{i}" not in taken)
            slot = WorkerSlot(f"{role}-{index}", role, cpus, replacing=True)
            self._slots[slot.name] = slot
            return slot

    def slot_cpus(self, worker: WorkerHandle) -> tuple[int, ...]:
        slot = self._slots.get(worker.slot)
        return () if slot is None else slot.cpus

    # ---- replacement ------------------------------------------------------------------------
    def _on_process_gone(self, dead: WorkerHandle) -> None:
        """A worker's process is gone (not stalled): the prefill workers forget a decode one
        (its channels close; they are not waited for), and a new worker starts in its slot."""
        if dead.role == "decode":
            for prefill in list(self.workers.values()):
                if prefill.role == "prefill" and (prefill.alive or prefill.stalled):
                    prefill.actor.forget_decode_peer.remote(dead.worker_id)
        self._replace_later(dead)

    def _replace_later(self, dead: WorkerHandle) -> None:
        """Start a worker in the slot of ``dead``, whose process is gone, from a thread of its
        own (a model takes minutes to load on a GPU). Nothing happens if the slot is starting
        one already or has used its ``max_worker_restarts``."""
        slot = self._slots.get(dead.slot)
        if slot is None or self._launcher is None or self.stopping.is_set() or dead.draining:
            return  # (a draining one was leaving its role: the rebalancer starts the other)
        with self._lock:
            if slot.replacing:
                return
            if slot.restarts >= self.config.max_worker_restarts:
                logger.error(
                    "%s worker %s is gone and its slot has used its %d restarts; "
                    "the %s pool stays one worker short",
                    dead.role,
                    dead.worker_id,
                    self.config.max_worker_restarts,
                    dead.role,
                )
                return
            slot.replacing = True
        self.spawn(self._replace, slot, name=f"replace-{slot.name}")

    def _replace(self, slot: WorkerSlot) -> None:
        """Start workers in ``slot`` until one joins the pools, the slot's restarts are used up,
        or the cluster stops; each failed start doubles the wait before the next."""
        max_restarts = self.config.max_worker_restarts
        try:
            while slot.restarts < max_restarts:
                delay_s = slot.delay_before_next_start_s(self.config.restart_delay_s)
                if self.stopping.wait(delay_s):
                    break
                slot.restarts += 1
                worker = self._start_in(slot)
                if worker is not None and self._join(worker, slot):
                    slot.failed_starts_in_a_row = 0
                    return  # (the join ended the slot's replacing)
                slot.failed_starts_in_a_row += 1
            else:
                logger.error(
                    "%s: no worker started in %d restarts; the %s pool stays one worker short",
                    slot.name,
                    slot.restarts,
                    slot.role,
                )
        except Exception:  # a bug: the slot stays empty, the rest of the cluster goes on
            logger.exception("replacing the worker of %s failed", slot.name)
        with self._lock:
            slot.replacing = False

    def _start_in(
        self, slot: WorkerSlot, place_within_s: float | None = None
    ) -> WorkerHandle | None:
        """A new worker in ``slot``, once it is ready; None if it failed to start (or the
        cluster stopped first, or its ranks were not placed within ``place_within_s``). It
        may wait long for Ray to place it: its node may be gone, and a new one takes the
        autoscaler minutes."""
        assert self._launcher is not None
        worker_id = slot.worker_id(slot.restarts)
        if slot.restarts:
            logger.warning(
                "starting %s worker %s in slot %s (restart %d of at most %d)",
                slot.role,
                worker_id,
                slot.name,
                slot.restarts,
                self.config.max_worker_restarts,
            )
        else:
            logger.warning("starting %s worker %s in a new slot", slot.role, worker_id)
        actor = self._launcher.launch(slot, worker_id, self.decode_handles())
        if place_within_s is not None and not self._placed_in_time(slot, place_within_s):
            logger.error(
                "%s worker %s: Ray did not place its ranks within %.0f s (no node has room)",
                slot.role,
                worker_id,
                place_within_s,
            )
            _kill(actor)
            return None
        ready = actor.ready.remote()
        while not ray.wait([ready], timeout=1.0)[0]:
            if self.stopping.is_set():
                _kill(actor)
                return None
        try:
            ray.get(ready)
        except ray.exceptions.RayError as error:
            logger.error("%s worker %s failed to start: %s", slot.role, worker_id, error)
            _kill(actor)
            return None
        return WorkerHandle(worker_id, slot.role, actor, slot=slot.name)

    def _placed_in_time(self, slot: WorkerSlot, within_s: float) -> bool:
        """Whether Ray places the ranks of the worker starting in ``slot`` within ``within_s``
        (False at once if the cluster stops meanwhile)."""
        assert self._launcher is not None
        deadline = time.monotonic() + within_s
        while not self._launcher.placed(slot.name, min(1.0, max(0.0, deadline - time.monotonic()))):
            if self.stopping.is_set() or time.monotonic() >= deadline:
                return False
        return True

    def _join(self, worker: WorkerHandle, slot: WorkerSlot) -> bool:
        """Put a started worker in rotation; False (and it is stopped) if it cannot join.

        Every prefill worker in rotation must know every decode worker in rotation (it hands
        off to the one the router picks). So a new decode worker is first announced to the
        prefill workers in rotation (a stalled one is given the list when it answers again,
        ``_probe``), and a new prefill worker is given the decode workers'. Joins are one at a
        time, under ``_membership``, and a stalled prefill worker is taken back only outside
        them, so none is missed.
        """
        with self._membership:
            if self.stopping.is_set():
                _kill(worker.actor)
                return False
            try:
                if worker.role == "decode":
                    self._announce(worker)
                else:
                    ref = worker.actor.add_decode_peers.remote(self.decode_handles())
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                asked_at = time.monotonic()  # routing reads loads: it joins with its first
                load = ray.get(worker.actor.load.remote(), timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayError as error:
                logger.error(
                    "%s worker %s could not join: %s", worker.role, worker.worker_id, error
                )
                _kill(worker.actor)
                return False
            with self._lock:
                self._admit_locked(worker, load, asked_at)
                slot.replacing = False
        logger.warning(
            "%s worker %s started in slot %s; in rotation",
            worker.role,
            worker.worker_id,
            slot.name,
        )
        return True

    def _admit_locked(self, worker: WorkerHandle, load: WorkerLoad, asked_at: float) -> None:
        """Put a worker started in a slot in rotation, with its first load, asked for at
        ``asked_at`` (under ``_membership`` too); the slot's earlier workers whose
        process is gone count as replaced."""
        load = self._take_timings(worker, load)
        worker.ledger.record(load, asked_at, lambda request_id: True)  # (it holds none yet)
        worker.last_report, worker.report_asked_at = time.monotonic(), asked_at
        for earlier in self.workers.values():  # a stalled one may still come back
            if earlier.slot == worker.slot and not (earlier.alive or earlier.stalled):
                earlier.replaced = True
        self.workers = {**self.workers, worker.worker_id: worker}
        self._joined.append(worker)
        if worker.role == "decode":
            self._decode_roster += 1

    def _announce(self, decode: WorkerHandle) -> None:
        """Tell the prefill workers in rotation of a new decode worker; one that does not answer
        goes out of rotation (reported by the next poll) and learns of it from its probe."""
        prefills = [w for w in self.workers.values() if w.role == "prefill" and w.alive]
        handles = {decode.worker_id: decode.actor}
        refs = [(w, w.actor.add_decode_peers.remote(handles)) for w in prefills]
        answer_by = time.monotonic() + CALL_TIMEOUT_S  # (under _membership: never long)
        for prefill, ref in refs:
            try:
                ray.get(ref, timeout=max(0.0, answer_by - time.monotonic()))
            except ray.exceptions.RayActorError:
                self._report_lost(prefill, stalled=False)
            except ray.exceptions.GetTimeoutError:
                self._report_lost(prefill, stalled=True)

    def _report_lost(self, worker: WorkerHandle, *, stalled: bool) -> None:
        """Take out a worker found lost on a pool thread; ``poll`` reports it."""
        if self.take_out(worker, stalled=stalled):
            with self._lock:
                self._lost.append(worker)

    # ---- threads and shutdown ---------------------------------------------------------------
    def spawn(self, target: Callable[..., None], *args: Any, name: str) -> None:
        """Run ``target(*args)`` on a daemon thread of the cluster's."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop_workers(self) -> None:
        """Stop every worker (a worker joining now joins first, and is stopped here too)."""
        self.stopping.set()
        with self._membership:
            workers = list(self.workers.values())
        stop_actors([w.actor for w in workers if w.alive or w.stalled])  # a hung one: one grace
        if self._launcher is not None:  # tensor-parallel workers' placement groups
            self._launcher.release_all()
        join_threads(self._threads, timeout_s=1.0)  # daemons: any left end with the process


def _answer(call: Any) -> WorkerLoad | None:
    """The answer to a load call, or None while it has none; raises the call's Ray error."""
    if not ray.wait([call], timeout=0)[0]:
        return None
    try:
        load: WorkerLoad = ray.get(call, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return None
    return load


def _kill(actor: Any) -> None:
    with contextlib.suppress(Exception):  # gone already
        ray.kill(actor)
