"""Live rebalancing (``--rebalance``): a worker moves between the prefill and decode pools when
one pool is the bottleneck and the other has room to spare.

Every report interval the rebalancer reads, per pool:
  pressure     -- how close the pool is to its SLO: the latency model's predicted TTFT of a
                  typical prompt (the recent requests' mean prompt and output lengths) over
                  ``--slo-ttft-ms`` for the prefill pool; its predicted TPOT over
                  ``--slo-tpot-ms`` for the decode pool;
  utilization  -- the share of the window its workers spent in engine steps (from the step
                  timings they report; router/busy_share.py).
A worker moves from pool A to pool B when, for a whole ``window_s``, B's pressure is at least
``pressure_high`` while A's is at most ``donor_pressure_low`` and A's utilization at most
``donor_utilization_low``, and A keeps at least one worker. A switch makes as many moves as
the shift needs (``RebalancePolicy._moves``): the fewest that bring B's pressure, projected as
spread over its workers, to ``settle_pressure``, as long as A's projected pressure and
utilization stay at most that (``--rebalance-max-moves`` bounds them). After a switch none
follows for ``cooldown_s`` (and the thresholds' gap keeps the two directions apart): roles do
not flap.
At the cooldown's end the switch is judged: one that did not lower its pool's pressure, as the
workers' step timings predict it, makes the next switch that way wait longer
(``RebalancePolicy``'s back-off); the verdict is logged.

A switch (``Rebalancer.switch``): the pool's least busy worker (or workers: one per move, all
drained at once, then changed at once, each in a thread of its own) stops being routed new work
(draining); what it holds runs on, for up to ``drain_timeout_s``; anything still on it then is
resumed elsewhere (a decode worker's requests are recomputed after the tokens their clients
have, as after a worker's loss: no request fails); then it is retired (out of rotation, its slot
closed) and its process becomes a worker of the other role, in a new slot of that pool: the
model's weights stay in memory, the engine is built anew for the role, on the same KV cache if
it drained (nothing writes to it any more) and the role's cache has its shape
(``WorkerActor.change_role``; a tensor-parallel worker's follower ranks rebuild with it, in
their own processes). Where the pools' workers have different numbers of ranks
(``--prefill-tp`` and ``--decode-tp`` differ) a switch is an exchange (``exchange``): as many
workers leave as the other pool's worker needs ranks (TP 1 to TP 2: two), their processes stop
and their reservations are given back, and as many workers of the other pool's size start as
that room holds (TP 4 to TP 2: two), where Ray places them; if Ray places none within
``place_timeout_s`` (no node has room), workers of the old role start again instead and the
pools keep their sizes. The switch is logged, counted
(``pdserve:role_switches_total{from_role,to_role}``) and charted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from router.busy_share import BusyShare
from router.latency_forecast import Forecast
from router.rebalance_policy import (
    ROLES,
    PoolSignals,
    RebalanceConfig,
    RebalancePolicy,
    Switch,
    exchange,
)
from router.worker_pool import WorkerHandle, WorkerPool

logger = logging.getLogger("router.rebalancer")
_DRAIN_POLL_S = 0.05
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


@dataclass(slots=True)
class _RecentRequests:
    """Mean prompt and output lengths of recent requests (exponentially weighted)."""

    prompt_tokens: float = 0.0
    max_tokens: float = 0.0
    seen: bool = False
    weight: float = 0.05

    def note(self, prompt_tokens: int, max_tokens: int) -> None:
        if not self.seen:
            self.prompt_tokens, self.max_tokens, self.seen = prompt_tokens, max_tokens, True
            return
        self.prompt_tokens += self.weight * (prompt_tokens - self.prompt_tokens)
        self.max_tokens += self.weight * (max_tokens - self.max_tokens)


class Rebalancer:
    def __init__(
        self,
        config: RebalanceConfig,
        pool: WorkerPool,
        forecast: Callable[[list[int], int], Forecast | None],
        num_placed_on: Callable[[str], int],
        recover: Callable[[list[WorkerHandle]], None],
    ) -> None:
        """``forecast(prompt, max_tokens)``: the cluster's; ``num_placed_on(worker_id)``: the
        requests placed on a worker; ``recover``: the placements' recovery of a worker's
        requests once it is out of rotation."""
        self.config = config
        sizes = {"prefill": pool.config.prefill_tp, "decode": pool.config.decode_tp}
        self.policy = RebalancePolicy(
            config, {(a, b): exchange(sizes[a], sizes[b]) for a in ROLES for b in ROLES if a != b}
        )
        self.pool = pool
        self._forecast = forecast
        self._num_placed_on = num_placed_on
        self._recover = recover
        self._recent = _RecentRequests()
        self._lock = threading.Lock()
        self._busy = BusyShare(config.window_s)  # each pool's busy share over the window
        self._switches: Counter[tuple[str, str]] = Counter()  # (from, to) role -> switches

    def note_request(self, prompt_tokens: int, max_tokens: int) -> None:
        with self._lock:
            self._recent.note(prompt_tokens, max_tokens)

    # ---- the loop -----------------------------------------------------------------------
    def run(self, interval_s: float) -> None:
        """Tick every ``interval_s`` until the pool stops (the cluster's thread)."""
        while not self.pool.stopping.wait(interval_s):
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug: keep serving with the pools as they are
                logger.exception("rebalancing failed")

    def tick(self, now: float) -> Switch | None:
        """Read the signals, decide, and carry out a switch; the switch made, if any."""
        signals = self.signals(now)
        if signals is None:
            return None
        decision = self.policy.decide(now, signals)
        for verdict in self.policy.take_verdicts():
            logger.warning(
                "rebalancing: %s; the next switch that way is allowed in %.0f s",
                verdict.describe(),
                max(0.0, verdict.next_allowed_at - now),
            )
        if decision is None:
            return None
        self.switch(decision)
        self.policy.switched(time.monotonic())
        return decision

    def signals(self, now: float) -> PoolSignals | None:
        """The pools' signals now; None before the latency model can predict (or before a
        first interval to measure utilization over)."""
        with self._lock:
            recent = self._recent
            if not recent.seen:
                return None
            prompt_len, max_tokens = round(recent.prompt_tokens), round(recent.max_tokens)
        self._busy.update(now, self.pool.latency_model.busy_seconds())
        workers = self._workers_by_role()
        shares = {role: self._busy.share(workers[role]) for role in ROLES}
        utilization = {role: share for role, share in shares.items() if share is not None}
        if len(utilization) < len(ROLES):
            return None
        forecast = self._forecast([0] * max(1, prompt_len), max(1, max_tokens))
        if forecast is None:
            return None
        return PoolSignals(
            {role: len(workers[role]) for role in ROLES},
            {
                "prefill": forecast.ttft_s / self.config.slo_ttft_s,
                "decode": forecast.tpot_s / self.config.slo_tpot_s,
            },
            utilization,
            {
                "prefill": forecast.steps_ttft_s / self.config.slo_ttft_s,
                "decode": forecast.steps_tpot_s / self.config.slo_tpot_s,
            },
        )

    def _workers_by_role(self) -> dict[str, list[str]]:
        workers: dict[str, list[str]] = {role: [] for role in ROLES}
        for worker in self.pool.workers.values():
            if worker.alive and not worker.draining and worker.role in workers:
                workers[worker.role].append(worker.worker_id)
        return workers

    # ---- a switch -------------------------------------------------------------------------
    def switch(self, decision: Switch) -> list[WorkerHandle]:
        """Move the least busy workers of ``decision.from_role`` (as many as its exchange
        gives) to the other pool; the new workers (none if none started: the pools are then
        as after a failed restart, or as before where the old role's workers came back)."""
        trade = decision.exchange
        leaving = self._least_busy(decision.from_role, trade.given)
        if not leaving:
            return []
        names = ", ".join(w.worker_id for w in leaving)
        several = len(leaving) > 1
        becomes = f"{trade.started} {decision.to_role} workers" if trade.started > 1 else (
            f"a {decision.to_role} worker"
        )  # fmt: skip
        logger.warning(
            "rebalancing: %s worker%s %s become%s %s (%s)",
            decision.from_role, "s" * several, names, "" if several else "s", becomes,
            decision.reason,
        )  # fmt: skip
        started = time.monotonic()
        for worker in leaving:
            self.pool.start_draining(worker.worker_id)
        drain_by = started + self.config.drain_timeout_s
        while any(self._num_placed_on(w.worker_id) for w in leaving):
            if time.monotonic() >= drain_by:
                break
            if self.pool.stopping.wait(_DRAIN_POLL_S):
                return []
        drained = time.monotonic()
        if self.pool.changes_roles_in_place:  # (pools of one size: one for one)
            rooms = {w.worker_id: self.pool.slot_cpus(w) for w in leaving}

            def change(worker: WorkerHandle) -> list[WorkerHandle]:
                changed = self._change_in_place(worker, decision, rooms[worker.worker_id])
                self._log_joined(changed, [worker], started, drained)
                return changed

            # all at once, each in rotation once changed (a GPU worker's engine takes its
            # time to build: one after another, the pool would wait for each in turn)
            joined = [w for changed in _at_once(change, leaving) for w in changed]
        else:
            joined = self._exchange(leaving, decision)
            self._log_joined(joined, leaving, started, drained)
        if not joined:
            return []
        with self._lock:
            self._switches[(decision.from_role, decision.to_role)] += 1
        return joined

    def _log_joined(
        self,
        joined: list[WorkerHandle],
        leaving: list[WorkerHandle],
        started: float,
        drained: float,
    ) -> None:
        """Log the workers that joined their new pool in place of ``leaving`` (none: nothing
        logged; the failure was)."""
        if not joined:
            return
        logger.warning(
            "rebalancing: %s worker %s in rotation in place of %s (%s; drained in %.1f s, "
            "joined %.1f s later)",
            joined[0].role,
            ", ".join(w.worker_id for w in joined),
            ", ".join(w.worker_id for w in leaving),
            "the same process" if joined[0].actor is leaving[0].actor else "a new process",
            drained - started,
            time.monotonic() - drained,
        )

    def _change_in_place(
        self, leaving: WorkerHandle, decision: Switch, cpus: tuple[int, ...]
    ) -> list[WorkerHandle]:
        """The leaving worker's processes become a worker of the other role (or, if that
        fails, a new one starts on the same cores)."""
        emptied = not self._num_placed_on(leaving.worker_id)  # (else: resumed elsewhere)
        joined = None
        if self.pool.retire(leaving, keep_placement=True):
            self._recover([leaving])  # what it still holds: resumed elsewhere
            joined = self.pool.change_role(leaving, decision.to_role, cpus, emptied)
        if joined is None:  # (lost meanwhile, or the change failed: it is stopped)
            joined = self.pool.start_worker(decision.to_role, cpus)
        if joined is None:
            logger.error(
                "rebalancing: no %s worker started in place of %s; the %s pool is one worker short",
                decision.to_role,
                leaving.worker_id,
                decision.to_role,
            )
            return []
        return [joined]

    def _exchange(self, leaving: list[WorkerHandle], decision: Switch) -> list[WorkerHandle]:
        """The leaving workers' processes stop and workers of the other pool's size start
        where Ray places them (each on the cores of the leaving workers whose room it takes,
        where workers are bound to cores); if Ray places none within ``place_timeout_s`` (no
        node has room), workers of the old role start again in the room given back."""
        num_started = decision.exchange.started
        cpus = [self.pool.slot_cpus(w) for w in leaving]
        for worker in leaving:
            if self.pool.retire(worker, keep_placement=False):
                self._recover([worker])  # what it still holds: resumed elsewhere
                self.pool.stop_retired(worker)
        rooms = [cpus[index * len(leaving) // num_started] for index in range(num_started)]

        def start(room: tuple[int, ...]) -> WorkerHandle | None:
            return self.pool.start_worker(decision.to_role, room, self.config.place_timeout_s)

        # all at once (a model takes its time to load on a GPU)
        joined = [w for w in _at_once(start, rooms) if w is not None]
        names = ", ".join(w.worker_id for w in leaving)
        if joined and len(joined) < num_started:
            logger.warning(
                "rebalancing: %d of %d %s workers started in place of %s (Ray placed no more)",
                len(joined), num_started, decision.to_role, names,
            )  # fmt: skip
        if joined:
            return joined
        restored = _at_once(lambda room: self.pool.start_worker(decision.from_role, room), cpus)
        back = [w.worker_id for w in restored if w is not None]
        logger.error(
            "rebalancing: no %s worker started in place of %s; %s",
            decision.to_role,
            names,
            f"{decision.from_role} workers {', '.join(back)} took their place"
            if back
            else f"the {decision.from_role} pool is {len(leaving)} worker(s) short",
        )
        return []

    def _least_busy(self, role: str, count: int) -> list[WorkerHandle]:
        """The ``count`` least busy workers of ``role``'s pool; none if it would keep none
        (the floor: a pool keeps one worker)."""
        candidates = [
            w for w in self.pool.workers.values() if w.role == role and w.alive and not w.draining
        ]
        if len(candidates) <= count:
            return []
        candidates.sort(key=lambda w: (self._num_placed_on(w.worker_id), w.worker_id))
        return candidates[:count]

    def switch_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._switches)


def _at_once(call: Callable[[_Item], _Result], items: Sequence[_Item]) -> list[_Result]:
    """``call`` of each item, each in a thread of its own (one: in this one), in their order."""
    if len(items) <= 1:
        return [call(item) for item in items]
    with ThreadPoolExecutor(len(items), thread_name_prefix="rebalancing") as threads:
        return list(threads.map(call, items))
