"""The planner's model of a CPU machine: the workers' steps and the host's other work share its
cores, each runnable thread getting cores / runnable of one while they outnumber the cores."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import pytest

from router.planner.shared_host import HostShare, SharedHost


class _Clock:
    """A minimal event loop: what the simulation gives the host."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


def _host(cores: int) -> tuple[_Clock, SharedHost, dict[str, float]]:
    clock = _Clock()
    return clock, SharedHost(HostShare(cores), lambda: clock.now, clock.at), {}


def _ends(clock: _Clock, ended: dict[str, float], name: str) -> Callable[[], None]:
    def done() -> None:
        ended[name] = clock.now

    return done


def test_steps_on_their_own_cores_take_their_time_alone_and_share_one_core() -> None:
    clock, host, ended = _host(2)
    host.start("a", 1.0, 1, _ends(clock, ended, "a"))
    host.start("b", 1.0, 1, _ends(clock, ended, "b"))
    clock.run()
    assert ended == pytest.approx({"a": 1.0, "b": 1.0})
    clock, host, ended = _host(1)
    host.start("a", 1.0, 1, _ends(clock, ended, "a"))
    host.start("b", 1.0, 1, _ends(clock, ended, "b"))
    clock.run()
    assert ended == pytest.approx({"a": 2.0, "b": 2.0})
    assert host.busy_thread_seconds == pytest.approx(2.0)


def test_a_step_starting_later_shares_the_core_from_then_on() -> None:
    """1 core: a runs alone for 0.5 s, then both at half speed: a's last 0.5 s take 1 s (ends
    at 1.5), when b has 0.5 s done and runs its rest alone (ends at 2.0)."""
    clock, host, ended = _host(1)
    host.start("a", 1.0, 1, _ends(clock, ended, "a"))
    clock.at(0.5, lambda: host.start("b", 1.0, 1, _ends(clock, ended, "b")))
    clock.run()
    assert ended == pytest.approx({"a": 1.5, "b": 2.0})


def test_streaming_takes_its_share_and_delivers_each_token_once_its_work_is_done() -> None:
    """2 cores, a step on 2 threads and two tokens' streaming of 0.25 s each: 3 threads
    runnable, each at 2/3: the tokens are delivered at 0.375 and 0.75 s, the step (0.5 s done
    by then) ends at 1.25 s."""
    clock, host, ended = _host(2)
    host.start("a", 1.0, 2, _ends(clock, ended, "a"))
    host.stream([(0.25, _ends(clock, ended, "first")), (0.25, _ends(clock, ended, "second"))])
    assert host.speed() == pytest.approx(2 / 3)
    clock.run()
    assert ended == pytest.approx({"first": 0.375, "second": 0.75, "a": 1.25})
    assert host.speed() == 1.0 and host.backlog_s == 0.0
    assert host.busy_thread_seconds == pytest.approx(2 * 1.0 + 0.5)


def test_free_streaming_is_delivered_at_once_unless_behind_other_tokens() -> None:
    clock, host, ended = _host(1)
    host.stream([(0.0, _ends(clock, ended, "free"))])
    clock.run()
    assert ended == {"free": 0.0}
    host.stream([(0.5, _ends(clock, ended, "costly"))])
    host.stream([(0.0, _ends(clock, ended, "behind"))])  # first come, first served
    clock.run()
    assert ended == pytest.approx({"free": 0.0, "costly": 0.5, "behind": 0.5})


def test_work_whose_end_nobody_waits_for_still_delays_the_tokens_behind_it() -> None:
    clock, host, ended = _host(1)
    host.stream([(0.3, lambda: None)])
    host.stream([(0.1, _ends(clock, ended, "token"))])
    clock.run()
    assert ended == pytest.approx({"token": 0.4})
    assert host.busy_thread_seconds == pytest.approx(0.4)


def test_more_front_door_threads_stream_faster_while_cores_are_free() -> None:
    clock = _Clock()
    host = SharedHost(HostShare(2, front_door_threads=2), lambda: clock.now, clock.at)
    ended: dict[str, float] = {}
    host.stream([(1.0, _ends(clock, ended, "t"))])  # on two threads of two cores: 0.5 s
    clock.run()
    assert ended == pytest.approx({"t": 0.5})


def test_a_worker_runs_one_step_at_a_time_and_bad_shares_are_refused() -> None:
    clock, host, ended = _host(1)
    host.start("a", 1.0, 1, _ends(clock, ended, "a"))
    with pytest.raises(ValueError, match="already runs a step"):
        host.start("a", 1.0, 1, _ends(clock, ended, "a"))
    with pytest.raises(ValueError, match="cores >= 1"):
        HostShare(0)
    with pytest.raises(ValueError, match="worker_seconds_per_batch and seconds_per_batch >= 0"):
        HostShare(2, -1.0)
    with pytest.raises(ValueError, match="worker_seconds_per_batch and seconds_per_batch >= 0"):
        HostShare(2, seconds_per_handoff=-1.0)
    with pytest.raises(ValueError, match="front_door_threads >= 1"):
        HostShare(2, front_door_threads=0)
