"""A worker whose process dies is replaced: a new worker starts in its slot, under a new id, and
joins the pools so that every prefill worker in rotation knows every decode worker in rotation.

The router is the real ``Cluster`` over fake actors (``fake_actors``: no Ray); replacements run
in the cluster's own threads, as in production, and the tests wait for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from router.cluster import Cluster
from router.worker_slots import MAX_RESTART_DELAY_S, WorkerSlot
from tests.router.fake_actors import FakeLauncher, make_cluster, stall, submit, use_fake_ray


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_ray(monkeypatch)
    yield


def _wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _alive(cluster: Cluster) -> set[str]:
    return {s.worker_id for s in cluster.worker_statuses() if s.alive}


def _launcher(cluster: Cluster) -> FakeLauncher:
    launcher = cluster.pool._launcher
    assert isinstance(launcher, FakeLauncher)
    return launcher


def _replaced(cluster: Cluster, worker_id: str) -> None:
    """Wait until ``worker_id`` has joined: in rotation at once, with its first load."""
    _wait_for(lambda: worker_id in cluster.pool.workers)
    assert worker_id in _alive(cluster)
    assert cluster.pool.workers[worker_id].load is not None  # routable before any load poll


def _only(cluster: Cluster, prefill: str, decode: str) -> None:
    """Route every request to these two workers."""
    cluster.placements.policy.choose_prefill = lambda info, loads: prefill  # type: ignore[method-assign]
    cluster.placements.policy.choose_decode = lambda info, loads: decode  # type: ignore[method-assign]


def test_a_dead_decode_worker_is_replaced_and_the_prefill_workers_hand_off_to_it() -> None:
    """Before, a decode worker whose process died left its pool one worker short until the
    cluster was restarted; a pool of one answered 503 for good."""
    cluster, actors = make_cluster(2, 1, launcher=True, restart_delay_s=0)
    actors["decode-0"].dead = True
    cluster.poll()
    assert "decode-0" not in _alive(cluster)
    _replaced(cluster, "decode-0-r1")
    assert _launcher(cluster).launched == ["decode-0-r1"]
    assert all("decode-0-r1" in actors[p].peers for p in ("prefill-0", "prefill-1"))
    for prefill in ("prefill-0", "prefill-1"):
        _only(cluster, prefill, "decode-0-r1")
        tracker, _ = submit(cluster, f"via-{prefill}")
        assert (tracker.prefill_worker, tracker.decode_worker) == (prefill, "decode-0-r1")
    assert cluster.is_ready()


def test_a_dead_prefill_worker_is_replaced_knowing_the_decode_workers_that_joined_since() -> None:
    cluster, actors = make_cluster(1, 2, launcher=True, restart_delay_s=0)
    actors["decode-1"].dead = True
    cluster.poll()
    _replaced(cluster, "decode-1-r1")
    actors["prefill-0"].dead = True
    cluster.poll()
    _replaced(cluster, "prefill-0-r1")
    assert set(actors["prefill-0-r1"].peers) >= {"decode-0", "decode-1-r1"}
    _only(cluster, "prefill-0-r1", "decode-1-r1")
    tracker, _ = submit(cluster, "r1")
    assert tracker.prefill_worker == "prefill-0-r1"


def test_a_stalled_prefill_worker_comes_back_knowing_a_decode_worker_that_joined_meanwhile() -> (
    None
):
    """prefill-0 is out of rotation (stalled) when decode-0's replacement joins: it was not
    told. Its probe carries the decode workers; a probe sent before the join is not enough."""
    cluster, actors = make_cluster(1, 1, launcher=True, restart_delay_s=0, dead_after_s=0.05)
    stall(cluster, actors, "prefill-0")
    cluster.poll()
    assert "prefill-0" not in _alive(cluster)
    assert cluster.pool.workers["prefill-0"].probe is not None  # sent before the join
    actors["decode-0"].dead = True
    cluster.poll()
    _wait_for(lambda: "decode-0-r1" in cluster.pool.workers)
    assert "decode-0-r1" not in actors["prefill-0"].peers
    actors["prefill-0"].stalled = False
    cluster.poll()  # the old probe answers, without the new decode worker: asked again
    cluster.poll()
    assert _alive(cluster) == {"prefill-0", "decode-0-r1"}
    assert "decode-0-r1" in actors["prefill-0"].peers
    _only(cluster, "prefill-0", "decode-0-r1")
    submit(cluster, "r1")


def test_a_stalled_worker_is_not_replaced_but_one_found_dead_by_its_probe_is() -> None:
    cluster, actors = make_cluster(1, 1, launcher=True, restart_delay_s=0, dead_after_s=0.05)
    stall(cluster, actors, "decode-0")
    cluster.poll()
    time.sleep(0.05)
    assert _launcher(cluster).launched == []  # its process lives: it may answer again
    actors["decode-0"].dead = True
    cluster.poll()
    _replaced(cluster, "decode-0-r1")


def test_restarts_are_bounded_and_a_failed_start_is_tried_again() -> None:
    """Every start fails (the model directory is gone, say): the slot gets exactly
    max_worker_restarts tries, then stays empty; a worker that starts later resets nothing."""
    cluster, actors = make_cluster(1, 2, launcher=True, restart_delay_s=0, max_worker_restarts=3)
    _launcher(cluster).failing_starts = 10
    actors["decode-1"].dead = True
    cluster.poll()
    slot = cluster.pool._slots["decode-1"]
    _wait_for(lambda: not slot.replacing)
    assert _launcher(cluster).launched == ["decode-1-r1", "decode-1-r2", "decode-1-r3"]
    assert all(actors[w].dead for w in _launcher(cluster).launched)  # killed, never joined
    assert slot.failed_starts_in_a_row == 3
    assert _alive(cluster) == {"prefill-0", "decode-0"}


def test_a_start_that_fails_once_is_followed_by_one_that_joins() -> None:
    cluster, actors = make_cluster(1, 1, launcher=True, restart_delay_s=0)
    _launcher(cluster).failing_starts = 1
    actors["decode-0"].dead = True
    cluster.poll()
    _replaced(cluster, "decode-0-r2")
    assert "decode-0-r1" not in cluster.pool.workers
    assert cluster.pool._slots["decode-0"].failed_starts_in_a_row == 0


def test_a_replacement_that_dies_is_replaced_in_turn() -> None:
    cluster, actors = make_cluster(1, 1, launcher=True, restart_delay_s=0)
    for restart in (1, 2):
        actors[
            cluster.pool.workers["decode-0"].worker_id if restart == 1 else "decode-0-r1"
        ].dead = True
        cluster.poll()
        _replaced(cluster, f"decode-0-r{restart}")
    assert _alive(cluster) == {"prefill-0", "decode-0-r2"}
    assert {"decode-0-r1", "decode-0-r2"} <= set(actors["prefill-0"].peers)


def test_statuses_leave_out_replaced_workers_and_restarts_are_counted_per_slot() -> None:
    """Before, a replaced worker's id stayed in the statuses (and in ``pdserve:worker_alive``
    at 0) for good, and nothing counted restarts. A failed start counts as a restart too."""
    cluster, actors = make_cluster(1, 2, launcher=True, restart_delay_s=0)
    _launcher(cluster).failing_starts = 1
    actors["decode-0"].dead = True
    cluster.poll()
    _replaced(cluster, "decode-0-r2")
    actors["decode-0-r2"].dead = True
    cluster.poll()
    _replaced(cluster, "decode-0-r3")
    statuses = {s.worker_id: s.alive for s in cluster.worker_statuses()}
    assert statuses == {"prefill-0": True, "decode-0-r3": True, "decode-1": True}
    restarts = {(r.slot, r.role): r.restarts for r in cluster.worker_restarts()}
    assert restarts == {
        ("decode-0", "decode"): 3,
        ("decode-1", "decode"): 0,
        ("prefill-0", "prefill"): 0,
    }


def test_a_dead_worker_stays_in_the_statuses_until_its_slot_has_a_new_one() -> None:
    cluster, actors = make_cluster(1, 1, launcher=True, restart_delay_s=0, max_worker_restarts=0)
    actors["decode-0"].dead = True
    cluster.poll()
    assert {s.worker_id: s.alive for s in cluster.worker_statuses()} == {
        "prefill-0": True,
        "decode-0": False,
    }


def test_no_restarts_leave_a_dead_worker_out() -> None:
    cluster, actors = make_cluster(1, 2, launcher=True, restart_delay_s=0, max_worker_restarts=0)
    actors["decode-0"].dead = True
    cluster.poll()
    time.sleep(0.05)
    assert _launcher(cluster).launched == [] and not cluster.pool._slots["decode-0"].replacing


def test_a_worker_started_while_the_cluster_shuts_down_is_stopped_not_joined() -> None:
    cluster, actors = make_cluster(1, 1, launcher=True, restart_delay_s=0)
    shutting_down = threading.Event()

    def shut_down_first() -> None:  # the start begins, and the cluster is asked to stop
        cluster.pool.stopping.set()
        shutting_down.set()

    _launcher(cluster).before_launch = shut_down_first
    actors["decode-0"].dead = True
    cluster.poll()
    assert shutting_down.wait(60)
    _wait_for(lambda: not cluster.pool._slots["decode-0"].replacing)
    assert actors["decode-0-r1"].dead and "decode-0-r1" not in cluster.pool.workers


def test_the_wait_before_a_start_doubles_with_each_failed_start() -> None:
    slot = WorkerSlot("decode-0", "decode")
    waits = []
    for failed in range(10):
        slot.failed_starts_in_a_row = failed
        waits.append(slot.delay_before_next_start_s(1.0))
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0]
    assert max(waits) == MAX_RESTART_DELAY_S == waits[-1]
    assert [slot.worker_id(r) for r in (0, 1, 2)] == ["decode-0", "decode-0-r1", "decode-0-r2"]


def test_the_prefill_workers_forget_a_dead_decode_worker_but_not_a_stalled_one() -> None:
    """Its channels hold memory (GPU memory, for NCCL) until forgotten."""
    cluster, actors = make_cluster(2, 2, dead_after_s=0.05)
    actors["decode-0"].dead = True
    stall(cluster, actors, "decode-1")
    cluster.poll()
    for prefill in ("prefill-0", "prefill-1"):
        forgotten = [args for name, args in actors[prefill].calls if name == "forget_decode_peer"]
        assert forgotten == [("decode-0",)]
    actors["decode-1"].dead = True  # found by its probe
    cluster.poll()
    forgotten = [args for name, args in actors["prefill-0"].calls if name == "forget_decode_peer"]
    assert forgotten == [("decode-0",), ("decode-1",)]
