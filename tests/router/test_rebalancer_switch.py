"""A switch's moves happen at once: the leaving workers' role changes (pools of one size), or
the new workers' starts (an exchange between sizes), each in a thread of its own, so a switch
of several moves takes about one change's time, not one per move (on a GPU, an engine built
anew or a model loaded). The pool here is a stand-in whose changes and starts each wait, at a
barrier, until all of the switch's have begun: one after another, the first would wait alone
and the switch would fail."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from router.rebalance_policy import Exchange, RebalanceConfig, Switch
from router.rebalancer import Rebalancer
from router.worker_pool import WorkerHandle

WAIT_S = 30.0  # at the barrier: far longer than threads take to start on a busy machine


class _Pool:
    """The pool's side of a switch: ``change_role`` and ``start_worker`` each meet the others
    of the switch at a barrier of ``parties`` before they return a worker."""

    def __init__(self, prefill: int, decode: int, tp: tuple[int, int], parties: int) -> None:
        self.config = SimpleNamespace(prefill_tp=tp[0], decode_tp=tp[1])
        self.workers = {
            f"{role}-{i}": WorkerHandle(f"{role}-{i}", role, actor=f"process {role}-{i}")
            for role, count in (("prefill", prefill), ("decode", decode))
            for i in range(count)
        }
        self.stopping = threading.Event()
        self.changes_roles_in_place = tp[0] == tp[1]
        self.barrier = threading.Barrier(parties, timeout=WAIT_S)
        self.stopped: list[str] = []
        self._ids = iter(range(100, 200))
        self._lock = threading.Lock()

    def start_draining(self, worker_id: str) -> None:
        self.workers[worker_id].draining = True

    def slot_cpus(self, worker: WorkerHandle) -> tuple[int, ...]:
        return (int(worker.worker_id.rsplit("-", 1)[1]),)

    def retire(self, worker: WorkerHandle, keep_placement: bool = False) -> bool:
        worker.alive, worker.retired = False, True
        return True

    def stop_retired(self, worker: WorkerHandle) -> None:
        self.stopped.append(worker.worker_id)

    def change_role(
        self, retired: WorkerHandle, role: str, cpus: tuple[int, ...] = (), drained: bool = True
    ) -> WorkerHandle:
        self.barrier.wait()  # (raises BrokenBarrierError if the others never come)
        return self._joined(role, retired.actor)

    def start_worker(
        self, role: str, cpus: tuple[int, ...] = (), place_within_s: float | None = None
    ) -> WorkerHandle:
        self.barrier.wait()
        return self._joined(role, f"new process on cores {cpus}")

    def _joined(self, role: str, actor: str) -> WorkerHandle:
        with self._lock:
            worker = WorkerHandle(f"{role}-{next(self._ids)}", role, actor)
            self.workers[worker.worker_id] = worker
        return worker


def _rebalancer(pool: _Pool) -> Rebalancer:
    config = RebalanceConfig(slo_ttft_s=1.0, slo_tpot_s=0.1, drain_timeout_s=1.0)
    return Rebalancer(config, pool, lambda prompt, max_tokens: None, lambda _: 0, lambda _: None)  # type: ignore[arg-type]


def test_workers_of_one_size_change_roles_at_once() -> None:
    """Three moves from a prefill pool of four: the three least busy (here: by id) change in
    their own processes, all at once; the pool keeps one."""
    pool = _Pool(prefill=4, decode=1, tp=(1, 1), parties=3)
    switch = Switch("prefill", "decode", "test", Exchange(1, 1).times(3))
    joined = _rebalancer(pool).switch(switch)
    assert sorted(w.actor for w in joined) == [f"process prefill-{i}" for i in range(3)]
    assert {w.role for w in joined} == {"decode"}
    assert [w.worker_id for w in pool.workers.values() if w.role == "prefill" and w.alive] == [
        "prefill-3"
    ]


def test_an_exchanges_new_workers_start_at_once() -> None:
    """Decode workers of two ranks giving way to prefill workers of one: one decode worker
    leaves, two prefill workers start on its cores, at once."""
    pool = _Pool(prefill=1, decode=2, tp=(1, 2), parties=2)
    switch = Switch("decode", "prefill", "test", Exchange(1, 2))
    joined = _rebalancer(pool).switch(switch)
    assert [w.actor for w in joined] == ["new process on cores (0,)"] * 2
    assert pool.stopped == ["decode-0"]


def test_one_move_runs_in_the_switchs_own_thread() -> None:
    pool = _Pool(prefill=2, decode=1, tp=(1, 1), parties=1)
    seen: list[str] = []
    change_role = pool.change_role

    def recorded(retired: WorkerHandle, role: str, *args: object) -> WorkerHandle:
        seen.append(threading.current_thread().name)
        return change_role(retired, role)

    pool.change_role = recorded  # type: ignore[method-assign]
    assert len(_rebalancer(pool).switch(Switch("prefill", "decode", "test"))) == 1
    assert seen == [threading.current_thread().name]


def test_a_change_that_waits_alone_is_what_one_after_another_would_do() -> None:
    """The stand-in's barrier does fail a lone change (so the tests above would fail were the
    changes made one after another)."""
    pool = _Pool(prefill=2, decode=1, tp=(1, 1), parties=2)
    pool.barrier = threading.Barrier(2, timeout=0.2)
    with pytest.raises(threading.BrokenBarrierError):
        pool.change_role(pool.workers["prefill-0"], "decode")
