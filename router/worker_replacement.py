"""Replacing dead workers: a new worker in the slot of one whose process is gone, joined to
the pools so that every prefill worker in rotation knows every decode worker in rotation.

``router.cluster.Cluster`` holds one ``WorkerReplacement`` and tells it of each worker whose
process is gone (``on_process_gone``). It is given what it uses of the cluster explicitly: the
slots and the launcher, the cluster's workers (read through a callable: the cluster swaps in a
new dict when one joins), its locks and stop event, and the calls that put a new worker in
rotation, carry its output stream, and take a worker that does not answer out of rotation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import ray

from router.worker_slots import CALL_TIMEOUT_S, WorkerLauncher, WorkerSlot

if TYPE_CHECKING:
    from engine.messages import WorkerLoad
    from router.cluster import WorkerHandle

logger = logging.getLogger("router.cluster")


class OnWorkerDead(Protocol):
    def __call__(self, worker: WorkerHandle, *, stalled: bool = False) -> None:
        """Take ``worker`` out of rotation and recover its requests elsewhere."""


class WorkerReplacement:
    """Starts a worker in the slot of one whose process is gone, each from a thread of its own,
    and joins it to the pools."""

    def __init__(
        self,
        launcher: WorkerLauncher | None,  # None: a dead worker's slot stays empty
        slots: Mapping[str, WorkerSlot],  # the cluster's, by name (their restarts count here)
        *,
        max_restarts: int,  # per slot (--max-worker-restarts)
        first_delay_s: float,  # the wait before a slot's first restart (then doubled)
        workers: Callable[[], Mapping[str, WorkerHandle]],  # the cluster's workers now, by id
        # (lock held) put a started worker in rotation with its first load and when it was
        # asked for; it replaces its slot's gone workers
        admit: Callable[[WorkerHandle, WorkerLoad, float], None],
        start_pump: Callable[[WorkerHandle], None],  # carry its output stream (a thread)
        on_worker_dead: OnWorkerDead,  # a worker that did not answer goes out of rotation
        spawn: Callable[..., None],  # spawn(target, *args, name=...): a cluster thread
        lock: threading.RLock,  # the cluster's: guards the slots' ``replacing``
        membership: threading.Lock,  # held while a worker joins (see ``_join``)
        stopping: threading.Event,  # set when the cluster shuts down
    ) -> None:
        self._launcher = launcher
        self._slots = slots
        self._max_restarts = max_restarts
        self._first_delay_s = first_delay_s
        self._workers = workers
        self._admit = admit
        self._start_pump = start_pump
        self._on_worker_dead = on_worker_dead
        self._spawn = spawn
        self._lock = lock
        self._membership = membership
        self._stopping = stopping

    def on_process_gone(self, dead: WorkerHandle) -> None:
        """A worker's process is gone (not stalled): the prefill workers forget a decode one
        (its channels close; they are not waited for), and a new worker starts in its slot."""
        if dead.role == "decode":
            for prefill in self._workers().values():
                if prefill.role == "prefill" and (prefill.alive or prefill.stalled):
                    prefill.actor.forget_decode_peer.remote(dead.worker_id)
        self._replace_later(dead)

    def _replace_later(self, dead: WorkerHandle) -> None:
        """Start a worker in the slot of ``dead``, whose process is gone, from a thread of its
        own (a model takes minutes to load on a GPU). Nothing happens if the slot is starting
        one already or has used its ``max_worker_restarts``."""
        slot = self._slots.get(dead.slot)
        if slot is None or self._launcher is None or self._stopping.is_set():
            return
        with self._lock:
            if slot.replacing:
                return
            if slot.restarts >= self._max_restarts:
                logger.error(
                    "%s worker %s is gone and its slot has used its %d restarts; "
                    "the %s pool stays one worker short",
                    dead.role,
                    dead.worker_id,
                    self._max_restarts,
                    dead.role,
                )
                return
            slot.replacing = True
        self._spawn(self._replace, slot, name=f"replace-{slot.name}")

    def _replace(self, slot: WorkerSlot) -> None:
        """Start workers in ``slot`` until one joins the pools, the slot's restarts are used up,
        or the cluster stops; each failed start doubles the wait before the next."""
        try:
            while slot.restarts < self._max_restarts:
                if self._stopping.wait(slot.delay_before_next_start_s(self._first_delay_s)):
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

    def _start_in(self, slot: WorkerSlot) -> WorkerHandle | None:
        """A new worker in ``slot``, once it is ready; None if it failed to start (or the
        cluster stopped first). It may wait long for Ray to place it: its node may be gone,
        and a new one takes the autoscaler minutes."""
        assert self._launcher is not None
        worker_id = slot.worker_id(slot.restarts)
        logger.warning(
            "starting %s worker %s in slot %s (restart %d of at most %d)",
            slot.role,
            worker_id,
            slot.name,
            slot.restarts,
            self._max_restarts,
        )
        actor = self._launcher.launch(slot, worker_id, decode_handles(self._workers().values()))
        ready = actor.ready.remote()
        while not ray.wait([ready], timeout=1.0)[0]:
            if self._stopping.is_set():
                _kill(actor)
                return None
        try:
            ray.get(ready)
        except ray.exceptions.RayError as error:
            logger.error("%s worker %s failed to start: %s", slot.role, worker_id, error)
            _kill(actor)
            return None
        from router.cluster import WorkerHandle  # (that module imports this one)

        return WorkerHandle(worker_id, slot.role, actor, slot=slot.name)

    def _join(self, worker: WorkerHandle, slot: WorkerSlot) -> bool:
        """Put a started worker in rotation; False (and it is stopped) if it cannot join.

        Every prefill worker in rotation must know every decode worker in rotation (it hands
        off to the one the router picks). So a new decode worker is first announced to the
        prefill workers in rotation (a stalled one is given the list when it answers again,
        ``Cluster._probe``), and a new prefill worker is given the decode workers'. Joins are
        one at a time, under ``_membership``, and a stalled prefill worker is taken back only
        outside them, so none is missed.
        """
        with self._membership:
            if self._stopping.is_set():
                _kill(worker.actor)
                return False
            try:
                if worker.role == "decode":
                    self._announce(worker)
                else:
                    handles = decode_handles(self._workers().values())
                    ref = worker.actor.add_decode_peers.remote(handles)
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                asked_at = time.monotonic()  # routing reads loads: it joins with its first
                load = ray.get(worker.actor.load.remote(), timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayError as error:
                logger.error(
                    "%s worker %s could not join: %s", worker.role, worker.worker_id, error
                )
                _kill(worker.actor)
                return False
            self._start_pump(worker)
            with self._lock:
                self._admit(worker, load, asked_at)
                slot.replacing = False
        logger.warning(
            "%s worker %s started in slot %s; in rotation",
            worker.role,
            worker.worker_id,
            slot.name,
        )
        return True

    def _announce(self, decode: WorkerHandle) -> None:
        """Tell the prefill workers in rotation of a new decode worker; one that does not
        answer goes out of rotation (and learns of it when it answers again)."""
        prefills = [w for w in self._workers().values() if w.role == "prefill" and w.alive]
        handles = {decode.worker_id: decode.actor}
        refs = [(w, w.actor.add_decode_peers.remote(handles)) for w in prefills]
        answer_by = time.monotonic() + CALL_TIMEOUT_S
        for prefill, ref in refs:
            try:
                ray.get(ref, timeout=max(0.0, answer_by - time.monotonic()))
            except ray.exceptions.RayActorError:
                self._on_worker_dead(prefill)
            except ray.exceptions.GetTimeoutError:
                self._on_worker_dead(prefill, stalled=True)


def decode_handles(workers: Iterable[WorkerHandle]) -> dict[str, Any]:
    """The decode workers of ``workers`` a prefill worker may be pointed at, by id: in
    rotation, or stalled (they may come back)."""
    return {w.worker_id: w.actor for w in workers if w.role == "decode" and (w.alive or w.stalled)}


def _kill(actor: Any) -> None:
    with contextlib.suppress(Exception):  # gone already
        ray.kill(actor)
