"""The router's failover over fake actors: deaths found while recovering, reports from a
placement given up, tokens from a worker taken out of rotation, tokens held across a resume.

Each scenario drives the real ``Cluster`` and ``RequestTracker`` (no Ray: ``fake_actors``)
through the calls its threads make: ``_poll_loads`` (the load monitor) and ``_dispatch`` (the
output pumps). Every one hung a client, crashed a router thread or corrupted a stream before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

import router.cluster
from engine.messages import GenerateRequest, OutputBatch, RequestFailure, TokenEvent, WorkerLoad
from engine.sampling.params import SamplingParams
from router.local_prefill import LocalPrefillRule
from router.placements import RequestFailedError
from router.policies import NoWorkerError
from router.request_tracker import RequestDone
from tests.router.fake_actors import make_cluster, stall, submit, token, token_ids, use_fake_ray


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_ray(monkeypatch)
    yield


def _first_of(cluster: router.cluster.Cluster, *preferred: str) -> None:
    """Route to the first live worker of ``preferred`` (then by name), deterministically."""

    def choose(info: object, loads: list) -> str:  # type: ignore[type-arg]
        live = sorted(load.worker_id for load in loads)
        if not live:
            raise NoWorkerError("no live worker")
        return next((w for w in preferred if w in live), live[0])

    cluster.placements.policy.choose_decode = choose  # type: ignore[method-assign]
    cluster.placements.policy.choose_prefill = choose  # type: ignore[method-assign]


def test_the_last_decode_worker_dying_fails_the_requests_still_prefilling() -> None:
    """With no live decode worker to point a prefill at, the requests fail with a reason (the
    NoWorkerError escaped the load monitor, which died, and both clients waited for ever)."""
    cluster, actors = make_cluster(1, 1)
    _, first = submit(cluster, "r1")
    _, second = submit(cluster, "r2")
    actors["decode-0"].dead = True
    cluster.poll()
    for items in (first, second):
        assert isinstance(items[-1], RequestFailure)
        assert "could not re-route" in items[-1].message
    assert not cluster.placements.num_open()
    assert actors["decode-0"].aborts() == []  # gone: no call is sent after it


def test_two_workers_dying_together_recover_each_request_once() -> None:
    """The prefill and decode worker of two requests die together. Looking for r1's decode
    worker finds it dead, and recovers r2 there and then; the prefill worker's pass must not
    recover r2 again (a KeyError escaped, or r2 was resumed twice, or failed while running)."""
    cluster, actors = make_cluster(1, 2, max_retries=1)
    _first_of(cluster, "decode-0")
    tracked = [submit(cluster, rid) for rid in ("r1", "r2")]
    for rid in ("r1", "r2"):
        cluster.placements.dispatch(OutputBatch("prefill-0", [token(rid, 0, 11)]))
    tracked[1][0].num_retries = 1  # r2 has no retry left
    actors["prefill-0"].dead = actors["decode-0"].dead = True
    cluster.poll()
    r1, r2 = (tracker for tracker, _ in tracked)
    assert (r1.decode_worker, r1.num_retries, r1.closed) == ("decode-1", 1, False)
    assert isinstance(tracked[1][1][-1], RequestFailure)  # retries exhausted: failed, once
    assert sorted(actors["decode-1"].requests) == ["r1#1"]  # r2 runs nowhere


def test_a_failure_from_a_placement_given_up_is_ignored() -> None:
    """r1 moved to decode-1 when decode-0 died; the prefill worker's hand-off to decode-0
    fails later. That report is about the old placement: r1 runs on (it was failed, or
    resumed a second time while still running on decode-1)."""
    cluster, actors = make_cluster(1, 2, max_retries=1)
    _first_of(cluster, "decode-0")
    tracker, items = submit(cluster, "r1", max_tokens=3)
    cluster.placements.dispatch(OutputBatch("prefill-0", [token("r1", 0, 11)]))
    actors["decode-0"].dead = True
    cluster.poll()
    assert (tracker.decode_worker, tracker.placement_id) == ("decode-1", "r1#1")
    cluster.placements.dispatch(OutputBatch("decode-1", [token("r1#1", 1, 12)]))
    late = RequestFailure("r1", "hand-off failed: decode-0 is gone", retryable=True)
    cluster.placements.dispatch(OutputBatch("prefill-0", [], [late]))
    cluster.placements.dispatch(OutputBatch("decode-1", [token("r1#1", 2, 13, finish="length")]))
    assert token_ids(items) == [11, 12, 13]
    assert isinstance(items[-1], RequestDone)
    assert tracker.num_retries == 1


def test_a_worker_that_accepted_a_placement_given_up_drops_the_request() -> None:
    """prefill-0 accepts r1, but r1's decode worker dies before the placement is recorded: r1
    is placed again on prefill-1, and prefill-0 is told to drop it (it prefilled it for
    nothing, and its failure later counted as one of r1's)."""
    cluster, actors = make_cluster(2, 2)
    _first_of(cluster, "prefill-0", "decode-0")
    accept = actors["prefill-0"].do_submit

    def accept_then_decode_dies(request, decode_id=None):  # type: ignore[no-untyped-def]
        accepted = accept(request, decode_id)
        actors["decode-0"].dead = True
        cluster.placements._lose(cluster.pool.workers["decode-0"])  # the monitor finds it meanwhile
        _first_of(cluster, "prefill-1", "decode-1")
        return accepted

    actors["prefill-0"].do_submit = accept_then_decode_dies  # type: ignore[method-assign]
    tracker, items = submit(cluster, "r1")
    assert (tracker.prefill_worker, tracker.decode_worker) == ("prefill-1", "decode-1")
    assert actors["prefill-0"].aborts() == ["r1"]
    stale = RequestFailure("r1", "hand-off to decode-0 failed", retryable=True)
    cluster.placements.dispatch(OutputBatch("prefill-0", [], [stale]))
    assert tracker.num_retries == 0 and not items


def test_tokens_from_a_worker_taken_out_of_rotation_never_reach_the_client() -> None:
    """decode-0 stalls past ``dead_after_s``: r1 resumes on decode-1 after the three tokens
    the client has. decode-0 wakes up and sends its fourth; the client must get decode-1's
    (it got a splice of the two samplings), and decode-0 is told to drop r1."""
    cluster, actors = make_cluster(0, 2, dead_after_s=0.1)
    _first_of(cluster, "decode-0")
    tracker, items = submit(cluster, "r1", max_tokens=6, temperature=1.0)
    cluster.placements.dispatch(
        OutputBatch("decode-0", [token("r1", p, 100 + p) for p in range(3)])
    )
    stall(cluster, actors, "decode-0")
    cluster.poll()
    assert (tracker.decode_worker, tracker.placement_id) == ("decode-1", "r1#1")
    assert actors["decode-0"].aborts() == ["r1"]
    cluster.placements.dispatch(OutputBatch("decode-0", [token("r1", 3, 103)]))
    tail = [token("r1#1", 3, 203), token("r1#1", 4, 204), token("r1#1", 5, 205, finish="length")]
    cluster.placements.dispatch(OutputBatch("decode-1", tail))
    assert token_ids(items) == [100, 101, 102, 203, 204, 205]


def test_tokens_held_back_from_a_placement_given_up_are_dropped() -> None:
    """decode-0's tokens 1 and 2 overtake prefill-0's token 0, then both workers die. r1
    starts again from its prompt elsewhere; the held tokens belong to the old sampling (they
    were released behind the new token 0, and the new worker's own dropped as duplicates)."""
    cluster, actors = make_cluster(2, 2)
    _first_of(cluster, "prefill-0", "decode-0")
    tracker, items = submit(cluster, "r1", max_tokens=5)
    cluster.placements.dispatch(OutputBatch("decode-0", [token("r1", 1, 901), token("r1", 2, 902)]))
    actors["prefill-0"].dead = actors["decode-0"].dead = True
    cluster.poll()
    assert (tracker.prefill_worker, tracker.decode_worker) == ("prefill-1", "decode-1")
    cluster.placements.dispatch(OutputBatch("prefill-1", [token("r1#1", 0, 100)]))
    rest = [token("r1#1", p, 100 + p, finish="length" if p == 4 else None) for p in range(1, 5)]
    cluster.placements.dispatch(OutputBatch("decode-1", rest))
    assert token_ids(items) == [100, 101, 102, 103, 104]


def test_the_prefill_worker_stays_in_charge_until_the_first_token_is_out() -> None:
    """decode-0's tokens overtake prefill-0's first token, and prefill-0 dies before that one
    is out. The request is still prefill-0's, so its death recovers it (it hung: decode-0
    never sends position 0)."""
    cluster, actors = make_cluster(2, 1)
    _first_of(cluster, "prefill-0")
    tracker, items = submit(cluster, "r1", max_tokens=3)
    cluster.placements.dispatch(OutputBatch("decode-0", [token("r1", 1, 901)]))
    assert tracker.prefill_worker == "prefill-0"
    actors["prefill-0"].dead = True
    cluster.poll()
    assert tracker.prefill_worker == "prefill-1" and tracker.num_retries == 1


def test_a_local_prefill_is_counted_once_however_many_tries_its_placement_takes() -> None:
    cluster, actors = make_cluster(1, 2, local_prefill=LocalPrefillRule(max_local_prompt_tokens=64))
    _first_of(cluster, "decode-0")
    actors["decode-0"].dead = True  # not found yet: the first try submits to it
    tracker, _ = submit(cluster, "r1", prompt=(1, 2, 3))
    assert tracker.decode_worker == "decode-1"
    assert cluster.local_prefills()["short"] == 1


def test_stalled_workers_are_found_in_one_poll_that_never_waits() -> None:
    """Three workers stop answering together: one load poll takes them all out, without
    waiting for any (a poll that waited for each in turn held up every other worker's report,
    and detection took three times as long)."""
    cluster, actors = make_cluster(1, 2, dead_after_s=5.0)
    for worker_id in list(cluster.pool.workers):
        stall(cluster, actors, worker_id)
    started = time.monotonic()
    cluster.poll()
    assert time.monotonic() - started < 1.0
    assert not any(worker.alive for worker in cluster.pool.workers.values())


def test_a_hand_off_that_fails_late_leaves_no_copy_running_on_its_decode_worker() -> None:
    """prefill-0's receipt from decode-0 times out after the KV went out: decode-0 does not
    hold r1 yet, but may admit it any moment. r1 resumes (here on decode-0 itself) under a
    new placement id, and decode-0 is told to drop the old copy (it ran on unseen, to its last
    token). The abort names the old placement only, so it cannot catch the new one."""
    cluster, actors = make_cluster(1, 2)
    _first_of(cluster, "decode-0")
    tracker, items = submit(cluster, "r1", max_tokens=3)
    cluster.placements.dispatch(OutputBatch("prefill-0", [token("r1", 0, 11)]))
    late = RequestFailure("r1", "hand-off failed: TimeoutError", retryable=True)
    cluster.placements.dispatch(OutputBatch("prefill-0", [], [late]))
    assert (tracker.decode_worker, tracker.placement_id) == ("decode-0", "r1#1")
    assert actors["decode-0"].aborts() == ["r1"]
    assert sorted(actors["decode-0"].requests) == ["r1#1"]
    cluster.placements.dispatch(
        OutputBatch("decode-0", [token("r1", 1, 901)])
    )  # the old copy: dropped
    tail = [token("r1#1", 1, 12), token("r1#1", 2, 13, finish="length")]
    cluster.placements.dispatch(OutputBatch("decode-0", tail))
    assert token_ids(items) == [11, 12, 13]
    assert {item.request_id for item in items} == {"r1"}  # the client knows one id
    assert not cluster.placements.num_open() and not cluster.placements._placed


def test_a_prefill_worker_dying_before_its_first_token_is_out_leaves_no_copy_running() -> None:
    """prefill-0 handed r1 off to decode-0 and died before its first token reached the router.
    r1 starts again from its prompt on prefill-1, and decode-0 drops the copy it admitted
    (it generated on, unseen, to its last token)."""
    cluster, actors = make_cluster(2, 1)
    _first_of(cluster, "prefill-0")
    tracker, items = submit(cluster, "r1", max_tokens=2)
    actors["decode-0"].requests["r1"] = tracker.request  # admitted from the hand-off
    actors["prefill-0"].dead = True
    cluster.poll()
    assert (tracker.prefill_worker, tracker.placement_id) == ("prefill-1", "r1#1")
    assert actors["decode-0"].aborts() == ["r1"]
    cluster.placements.dispatch(OutputBatch("prefill-1", [token("r1#1", 0, 21)]))
    cluster.placements.dispatch(OutputBatch("decode-0", [token("r1#1", 1, 22, finish="length")]))
    assert token_ids(items) == [21, 22] and isinstance(items[-1], RequestDone)


def test_a_request_id_in_use_as_a_placement_id_is_refused() -> None:
    cluster, _ = make_cluster(1, 1)
    _first_of(cluster, "decode-0")
    tracker, _ = submit(cluster, "r1")
    cluster.placements.dispatch(OutputBatch("prefill-0", [token("r1", 0, 11)]))
    cluster.placements.dispatch(
        OutputBatch("prefill-0", [], [RequestFailure("r1", "x", retryable=True)])
    )
    assert tracker.placement_id == "r1#1"
    with pytest.raises(ValueError, match="already in use"):
        submit(cluster, "r1#1")


def test_every_samples_first_token_from_the_prefill_worker_reaches_the_client() -> None:
    """n=2: decode-0's tokens overtake prefill-0's first tokens. Sample 0's first token releases
    its decode tokens; the router took that as the prefill phase over and dropped prefill-0 from
    the request in the middle of its batch, so sample 1's first token was discarded and the
    client waited for ever."""
    cluster, _ = make_cluster(1, 1)
    tracker, items = submit(cluster, "r1", n=2, max_tokens=2)
    overtaking = [
        TokenEvent("r1", sample, 1, 12 + 10 * sample, None, "length") for sample in (0, 1)
    ]
    cluster.placements.dispatch(OutputBatch("decode-0", overtaking))
    first = [TokenEvent("r1", sample, 0, 11 + 10 * sample, None, None) for sample in (0, 1)]
    cluster.placements.dispatch(OutputBatch("prefill-0", first))
    assert tracker.delivered == {0: [11, 12], 1: [21, 22]}
    assert isinstance(items[-1], RequestDone)
    assert not cluster.placements.num_open() and not cluster.placements._placed


def test_a_worker_out_of_rotation_keeps_no_charges() -> None:
    """A dead worker's report never comes again, and only a report dropped the charges of the
    requests it held: they stayed in its ledger for good (and in its status's load)."""
    cluster, actors = make_cluster(1, 2)
    _first_of(cluster, "decode-0")
    submit(cluster, "r1")
    submit(cluster, "r2")
    actors["decode-0"].dead = True
    cluster.poll()
    assert cluster.pool.workers["decode-0"].ledger.num_charges == 0


def test_a_client_that_cannot_take_its_tokens_does_not_cost_the_others_theirs() -> None:
    """r1's client is gone (its event loop closed: handing it a token raises). The same batch's
    token for r2 still reaches r2, r1 is forgotten and its worker told to drop it (the error
    escaped ``_dispatch`` mid-batch: r2's token was lost)."""
    cluster, actors = make_cluster(1, 1)
    request = GenerateRequest("r1", [1, 2, 3], SamplingParams(), cluster.gateway_id)

    def closed_loop(item: object) -> None:
        raise RuntimeError("Event loop is closed")

    cluster.submit(request, closed_loop)
    _, second = submit(cluster, "r2")
    batch = OutputBatch("prefill-0", [token("r1", 0, 11), token("r2", 0, 12)])
    cluster.placements.dispatch(batch)
    assert token_ids(second) == [12]
    assert cluster.placements.tracker("r1") is None and "r1" not in cluster.placements._placed
    assert "r1" in actors["prefill-0"].aborts()


def test_a_stalled_worker_that_answers_again_is_back_in_rotation() -> None:
    """decode-0 stops answering (a long pause; its process lives on), goes out of rotation and
    its request resumes on decode-1. Once it answers a load poll again it takes new requests:
    before, it stayed out for good, and a pool whose only worker paused for 10 s answered 503
    until the server was restarted."""
    cluster, actors = make_cluster(1, 2, dead_after_s=0.1)
    _first_of(cluster, "decode-0")
    tracker, _ = submit(cluster, "r1", max_tokens=4)
    stall(cluster, actors, "decode-0")
    handle = cluster.pool.workers["decode-0"]
    cluster.poll()
    assert not handle.alive and tracker.decode_worker == "decode-1"
    assert actors["decode-0"].aborts() == ["r1"]

    def load_calls() -> int:
        return sum(name == "load" for name, _ in actors["decode-0"].calls)

    before = load_calls()
    for _ in range(3):  # still silent: one probe at a time, never a wait
        started = time.monotonic()
        cluster.poll()
        assert time.monotonic() - started < 0.05 and not handle.alive
    assert load_calls() == before  # the probe sent when it went out is the only one
    actors["decode-0"].stalled = False
    cluster.poll()
    assert handle.alive and not handle.stalled
    assert {s.worker_id for s in cluster.worker_statuses() if s.alive} == {
        "prefill-0",
        "decode-0",
        "decode-1",
    }
    second, _ = submit(cluster, "r2")
    assert second.decode_worker == "decode-0"


def test_a_dead_worker_stays_out_and_is_not_asked_again() -> None:
    """A worker whose process is gone (its calls fail, they do not time out) is never probed;
    a stalled one found dead by its probe is out for good too."""
    cluster, actors = make_cluster(1, 2, dead_after_s=0.1)
    actors["decode-0"].dead = True
    stall(cluster, actors, "decode-1")
    cluster.poll()
    assert not cluster.pool.workers["decode-1"].alive and cluster.pool.workers["decode-1"].stalled
    actors["decode-1"].dead = True
    cluster.poll()
    calls = {w: len(actors[w].calls) for w in ("decode-0", "decode-1")}
    for _ in range(2):
        cluster.poll()
    assert {w: len(actors[w].calls) for w in calls} == calls
    assert not any(cluster.pool.workers[w].alive or cluster.pool.workers[w].stalled for w in calls)


def test_a_late_worker_is_routed_to_last_and_taken_out_only_after_dead_after_s() -> None:
    """Slow is not dead. decode-0 stops answering: while its silence is shorter than
    ``dead_after_s`` it stays in rotation with its request (before, a report 5 s late took a
    live worker out and the client got 503), and new requests go to decode-1, which reports in
    time. Only once it has been silent for ``dead_after_s`` is it out, its request resumed."""
    cluster, actors = make_cluster(1, 2, dead_after_s=30.0, late_after_s=2.0)
    _first_of(cluster, "decode-0")
    first, items = submit(cluster, "r1", max_tokens=4)
    assert first.decode_worker == "decode-0"
    actors["decode-0"].stalled = True
    decode_0 = cluster.pool.workers["decode-0"]
    decode_0.last_report -= 10.0  # late, not dead
    cluster.poll()
    assert decode_0.alive and first.decode_worker == "decode-0" and not items
    second, _ = submit(cluster, "r2")
    assert second.decode_worker == "decode-1"  # decode-0 is late: routed to last
    actors["decode-1"].stalled = True
    cluster.pool.workers["decode-1"].last_report -= 10.0
    third, _ = submit(cluster, "r3")  # both late: still placed, on the policy's choice
    assert third.decode_worker == "decode-0"
    decode_0.last_report -= 30.0  # silent for dead_after_s
    cluster.poll()
    assert not decode_0.alive and decode_0.stalled
    assert first.decode_worker == "decode-1"  # its prefill worker hands it off there


def test_a_request_keeps_its_priority_on_every_worker_it_is_placed_on() -> None:
    """Under the scheduling policy "priority", ``generate``'s priority goes with the request to
    its prefill worker (which hands it to the decode worker), and with the resumed request to
    the decode worker that takes it over after the first one died (it was rebuilt without it,
    and ran there as 0)."""
    cluster, actors = make_cluster(1, 2, scheduling_policy="priority")
    _first_of(cluster, "decode-0")

    def placed() -> bool:
        tracker = cluster.placements.tracker("r1")
        return tracker is not None and bool(tracker.workers)

    async def client() -> list[int]:
        params = SamplingParams(max_tokens=2)
        stream = cluster.generate([1, 2, 3, 4], params, request_id="r1", priority=-3)
        reading = asyncio.ensure_future(_token_ids_from(stream))
        deadline = time.monotonic() + 60
        while not placed():  # in the cluster's placement thread
            assert time.monotonic() < deadline, "r1 was never placed"
            await asyncio.sleep(0.01)
        cluster.placements.dispatch(OutputBatch("prefill-0", [token("r1", 0, 11)]))
        actors["decode-0"].dead = True
        cluster.poll()
        cluster.placements.dispatch(
            OutputBatch("decode-1", [token("r1#1", 1, 12, finish="length")])
        )
        return await asyncio.wait_for(reading, 5)

    assert asyncio.run(client()) == [11, 12]
    first = actors["prefill-0"].requests["r1"]
    assert (first.priority, actors["prefill-0"].targets["r1"]) == (-3, "decode-0")
    resumed = actors["decode-1"].requests["r1#1"]
    assert (resumed.priority, resumed.resume_token_ids) == (-3, {0: [11]})


async def _token_ids_from(stream: AsyncIterator[TokenEvent]) -> list[int]:
    return [event.token_id async for event in stream]


def test_requests_wait_for_a_late_pool_in_a_bounded_queue() -> None:
    """Every worker of a pool is late (its reports overdue, its process alive): a request
    waits in the router instead of failing, and is placed once a worker reports in time. The
    queue is bounded: a request beyond ``max_waiting_requests`` fails at once (503 with
    Retry-After at the front doors), never piling up."""
    cluster, _ = make_cluster(
        1, 1, late_after_s=1.0, report_interval_s=0.01, max_waiting_requests=1
    )
    for worker in cluster.pool.workers.values():
        worker.last_report -= 5.0  # late, not dead (dead_after_s is 30 s)

    async def main() -> None:
        waiting = asyncio.ensure_future(_token_ids_from(cluster.generate([1, 2], SamplingParams())))
        deadline = time.monotonic() + 10
        while cluster._num_waiting < 1:
            assert time.monotonic() < deadline, "the request never waited"
            await asyncio.sleep(0.005)
        assert not cluster.placements.num_open()  # not placed yet
        assert cluster.queue_is_full()  # the front doors now refuse with 503 at once
        with pytest.raises(RequestFailedError, match="already waiting for a worker"):
            await _token_ids_from(cluster.generate([3, 4], SamplingParams()))
        cluster.poll()  # both workers report in time again
        while not cluster.placements.num_open():
            assert time.monotonic() < deadline, "the request was never placed"
            await asyncio.sleep(0.005)
        assert cluster._num_waiting == 0 and not cluster.queue_is_full()
        waiting.cancel()

    asyncio.run(main())


def test_a_worker_taken_out_by_a_placement_during_a_poll_is_skipped_by_the_poll() -> None:
    """A placement thread finds decode-1 dead while a load poll is between asking and looking
    (the poll once read the call the placement had cleared, raised, and dropped the workers it
    had itself taken out that round: their requests hung)."""
    cluster, actors = make_cluster(0, 2)
    _first_of(cluster, "decode-1")
    tracker, _ = submit(cluster, "r1", max_tokens=4)

    def load_finding_decode_1_dead(kv_cursor: object = None) -> WorkerLoad:
        actors["decode-1"].dead = True
        cluster.placements._lose(cluster.pool.workers["decode-1"])
        return WorkerLoad("decode-0", 0, 0, 0, 0.0)

    actors["decode-0"].do_load = load_finding_decode_1_dead  # type: ignore[method-assign]
    cluster.poll()
    assert tracker.decode_worker == "decode-0" and tracker.num_retries == 1


def test_a_worker_a_failed_poll_took_out_is_recovered_by_the_next() -> None:
    """The poll takes decode-0 out, then fails on the next worker (a bug): decode-0's requests
    are recovered by the next round, not dropped with the round that failed."""
    cluster, actors = make_cluster(0, 2)
    _first_of(cluster, "decode-0")
    tracker, _ = submit(cluster, "r1", max_tokens=4)
    actors["decode-0"].dead = True

    def broken_load(kv_cursor: object = None) -> WorkerLoad:
        raise RuntimeError("a bug in a load report")

    actors["decode-1"].do_load = broken_load  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        cluster.poll()
    assert not cluster.pool.workers["decode-0"].alive and tracker.decode_worker == "decode-0"
    del actors["decode-1"].do_load  # its reports work again
    cluster.poll()
    assert tracker.decode_worker == "decode-1" and tracker.num_retries == 1


def _stuck_for(worker_id: str, seconds: float) -> WorkerLoad:
    """A load report answered at once by a worker whose engine has not moved for ``seconds``."""
    return WorkerLoad(worker_id, 0, 1, 0, 0.1, seconds_since_progress=seconds)


def test_a_worker_whose_engine_is_stuck_is_late_then_stalled_though_it_answers() -> None:
    """decode-0 answers every load poll (its reports never wait for the engine) but its engine
    is stuck in one step: past ``late_after_s`` it is routed to last, past ``dead_after_s`` it
    is out and its request resumed elsewhere, and it comes back only once its engine moves."""
    cluster, actors = make_cluster(0, 2, late_after_s=2.0, dead_after_s=30.0)
    _first_of(cluster, "decode-0")
    first, _ = submit(cluster, "r1", max_tokens=4)
    stuck_s = 5.0
    actors["decode-0"].do_load = lambda kv_cursor=None: _stuck_for("decode-0", stuck_s)  # type: ignore[method-assign]
    cluster.poll()
    decode_0 = cluster.pool.workers["decode-0"]
    assert decode_0.alive
    assert submit(cluster, "r2")[0].decode_worker == "decode-1"  # late: routed to last
    stuck_s = 31.0
    cluster.poll()
    assert not decode_0.alive and decode_0.stalled
    assert first.decode_worker == "decode-1" and actors["decode-0"].aborts() == ["r1"]
    cluster.poll()  # its probe answers, its engine still stuck: it stays out
    assert not decode_0.alive
    stuck_s = 0.0
    cluster.poll()
    assert decode_0.alive and not decode_0.stalled


def test_a_stalled_worker_is_told_to_drop_a_request_aborted_before_its_recovery() -> None:
    """The load poll has taken decode-0 out (stalled) and not yet recovered its requests when
    r1's client leaves: decode-0, whose process may live on, is told to drop r1 (it ran on
    unseen when it woke, its blocks held)."""
    cluster, actors = make_cluster(0, 2)
    _first_of(cluster, "decode-0")
    submit(cluster, "r1", max_tokens=4)
    assert cluster.pool.take_out(cluster.pool.workers["decode-0"], stalled=True)
    cluster.abort("r1")
    assert actors["decode-0"].aborts() == ["r1"]


def test_a_request_whose_recovery_fails_is_failed_and_the_others_are_recovered() -> None:
    """Recovering r1 from a dead worker raises (a bug): r1's client is told, and r2 on the
    same worker is resumed all the same (before, the error left both waiting for ever)."""
    cluster, actors = make_cluster(0, 2)
    _first_of(cluster, "decode-0")
    first, first_items = submit(cluster, "r1", max_tokens=4)
    second, _ = submit(cluster, "r2", max_tokens=4)
    choose = cluster.placements.policy.choose_decode

    def choose_failing_for_r1(info, loads):  # type: ignore[no-untyped-def]
        if info.request_id == "r1":
            raise RuntimeError("a bug in routing")
        return choose(info, loads)

    cluster.placements.policy.choose_decode = choose_failing_for_r1  # type: ignore[method-assign]
    actors["decode-0"].dead = True
    cluster.poll()
    assert isinstance(first_items[-1], RequestFailure) and first.closed
    assert second.decode_worker == "decode-1" and second.num_retries == 1


def test_a_request_that_ends_stops_counting_towards_its_workers_load_at_once() -> None:
    """A conversation's next turn comes as soon as the last one ends: the ended one's charge
    (its prompt tokens queued on the decode worker that prefilled it) is gone by then, not at
    the next load report."""
    cluster, _ = make_cluster(0, 1)
    submit(cluster, "r1", prompt=tuple(range(3, 40)), max_tokens=1)
    load = cluster.pool.load_of("decode-0")
    assert load is not None and load.num_queued_prompt_tokens == 37
    cluster.placements.dispatch(OutputBatch("decode-0", [token("r1", 0, 7, "length")]))
    load = cluster.pool.load_of("decode-0")
    assert load is not None and (load.num_queued_prompt_tokens, load.num_running) == (0, 0)
