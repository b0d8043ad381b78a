"""The cluster on a local Ray: token-exact against the offline engine, and failover."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray

from engine import LLM, SamplingParams
from engine.scheduler import SchedulerConfig
from router.cluster import Cluster
from router.cluster_config import ClusterConfig
from router.local_prefill import LocalPrefillRule
from tests.engine.test_parity import make_prompts
from tests.fixtures.local_cluster import local_cluster_config

pytestmark = pytest.mark.timeout(180)

NUM_REQUESTS = 32


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompt_sets = [make_prompts(seed=s) for s in (31, 32, 33, 34)]
    prompts = list(itertools.islice(itertools.chain(*prompt_sets), NUM_REQUESTS))
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + (7 * i) % 29, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    prompts, params = _workload()
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture
def start_cluster(ray_session: None) -> Iterator:  # type: ignore[type-arg]
    started: list[Cluster] = []

    def start(config: ClusterConfig) -> Cluster:
        started.append(Cluster.start(config))
        return started[-1]

    yield start
    for cluster in started:
        cluster.shutdown()


async def _collect(
    cluster: Cluster, prompt: list[int], params: SamplingParams, priority: int = 0
) -> list[int]:
    return [event.token_id async for event in cluster.generate(prompt, params, priority=priority)]


def _run_all(cluster: Cluster) -> list[list[int]]:
    prompts, params = _workload()

    async def main() -> list[list[int]]:
        return list(
            await asyncio.gather(*(_collect(cluster, p, s) for p, s in zip(prompts, params)))
        )

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("num_prefill", "num_decode", "extra"),
    [
        (1, 1, {}),
        (2, 2, {}),
        (2, 2, {"router_policy": "prefix_affinity"}),
        (2, 2, {"max_num_batched_tokens": 32}),
        (0, 2, {}),
    ],
    ids=["1p1d", "2p2d", "2p2d-prefix-affinity", "2p2d-chunked", "colocated"],
)
def test_concurrent_greedy_requests_match_offline_engine(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],
    num_prefill: int,
    num_decode: int,  # type: ignore[no-untyped-def]
    extra: dict[str, object],
) -> None:
    cluster = start_cluster(
        local_cluster_config(llama_dir, num_prefill=num_prefill, num_decode=num_decode, **extra)
    )
    assert _run_all(cluster) == expected
    # --kv-transport auto: every pair is on this host, so every channel is shared memory
    transports = {w.worker_id: _channel_transports(w.actor) for w in cluster.pool.workers.values()}
    opened = [t for per_worker in transports.values() for t in per_worker.values()]
    assert set(opened) == ({"shm"} if num_prefill else set()), transports
    # each worker froze its start-up heap: its collections skip the model's objects
    frozen = {w.worker_id: _frozen_objects(w.actor) for w in cluster.pool.workers.values()}
    assert all(count > 10_000 for count in frozen.values()), frozen


def _frozen_objects(actor: object) -> int:
    frozen = actor.__ray_call__.remote  # type: ignore[attr-defined]
    return int(ray.get(frozen(lambda self: gc.get_freeze_count())))


def _channel_transports(actor: object) -> dict[str, str]:
    ref = actor.__ray_call__.remote(  # type: ignore[attr-defined]
        lambda self: getattr(self.worker, "channel_transports", dict)()
    )
    return dict(ray.get(ref))


def _scheduler_config(actor: object) -> SchedulerConfig:
    ref = actor.__ray_call__.remote(  # type: ignore[attr-defined]
        lambda self: self.worker.loop.engine.scheduler.config
    )
    return ray.get(ref)  # type: ignore[no-any-return]


def test_the_prefill_pool_runs_its_own_step_budget(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    config = local_cluster_config(
        llama_dir, num_prefill=1, num_decode=1, prefill_max_num_batched_tokens=16
    )
    cluster = start_cluster(config)
    budgets = {
        w.worker_id: _scheduler_config(w.actor).max_num_batched_tokens
        for w in cluster.pool.workers.values()
    }
    assert budgets == {"prefill-0": 16, "decode-0": 2048}
    assert _run_all(cluster) == expected  # prompts over 16 tokens prefill in chunks


def test_short_prompts_are_prefilled_on_their_decode_worker(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    rule = LocalPrefillRule(max_local_prompt_tokens=40)
    cluster = start_cluster(
        local_cluster_config(llama_dir, num_prefill=1, num_decode=1, local_prefill=rule)
    )
    assert _run_all(cluster) == expected
    cluster.poll_until_reported(time.monotonic())
    counters = {s.worker_id: s.load.counters for s in cluster.worker_statuses()}
    prompts, _ = _workload()
    long = [len(p) for p in prompts if len(p) > 40]
    short = [len(p) for p in prompts if len(p) <= 40]
    assert long and short
    # no hand-off for a short prompt: its decode worker computed it
    assert {w: c.num_kv_transfers for w, c in counters.items()} == {
        "prefill-0": len(long),
        "decode-0": len(long),
    }
    assert {w: c.num_prefill_tokens for w, c in counters.items()} == {
        "prefill-0": sum(long),
        "decode-0": sum(short),
    }


def test_an_async_scheduling_cluster_serves_every_request_as_the_offline_engine(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    """--async-scheduling reaches both pools' schedulers; prefill hands off and decode steps
    ahead of its results, token for token as offline."""
    config = local_cluster_config(llama_dir, num_prefill=1, num_decode=1, async_scheduling=True)
    cluster = start_cluster(config)
    modes = {
        w.worker_id: _scheduler_config(w.actor).async_scheduling
        for w in cluster.pool.workers.values()
    }
    assert modes == {"prefill-0": True, "decode-0": True}
    assert _run_all(cluster) == expected


def test_a_priority_cluster_serves_requests_of_every_priority_as_the_offline_engine(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    """--scheduling-policy priority reaches both pools' schedulers, and requests of mixed
    priorities (negative ones too) come out token for token as offline."""
    config = local_cluster_config(
        llama_dir, num_prefill=1, num_decode=1, scheduling_policy="priority"
    )
    cluster = start_cluster(config)
    policies = {
        w.worker_id: _scheduler_config(w.actor).policy for w in cluster.pool.workers.values()
    }
    assert policies == {"prefill-0": "priority", "decode-0": "priority"}
    prompts, params = _workload()

    async def main() -> list[list[int]]:
        outputs = [
            _collect(cluster, prompt, sampling, priority=i % 3 - 1)
            for i, (prompt, sampling) in enumerate(zip(prompts, params))
        ]
        return list(await asyncio.gather(*outputs))

    assert asyncio.run(main()) == expected


def test_waiting_requests_start_in_order_of_priority_not_arrival(
    start_cluster,
    llama_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    """One sequence at a time: while a request runs to the end of the context, with two more
    of its priority queued behind it (about 2 s of work in all, so the rest queue in time on a
    slow machine), "late" (priority 5) arrives, then "urgent" (-5). Urgent starts before late
    (in order of arrival, late would)."""
    config = local_cluster_config(
        llama_dir, num_prefill=0, num_decode=1, max_num_seqs=1, scheduling_policy="priority"
    )
    cluster = start_cluster(config)
    prompt = make_prompts(seed=31)[0]
    started: list[str] = []

    async def run(name: str, priority: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for event in cluster.generate(prompt, params, request_id=name, priority=priority):
            if event.position == 0:
                started.append(name)

    def placed(name: str) -> bool:  # its worker holds it: running, or waiting for a turn
        tracker = cluster.placements.tracker(name)
        return tracker is not None and bool(tracker.workers)

    async def main() -> None:
        long = 511 - len(prompt)  # to the end of the context: about 0.5 s each
        first = asyncio.create_task(run("first", -10, long))
        await _wait_for(lambda: started == ["first"])
        queued = []
        for i in range(2):
            queued.append(asyncio.create_task(run(f"queued-{i}", -10, long)))
            await _wait_for(functools.partial(placed, f"queued-{i}"))
        late = asyncio.create_task(run("late", 5, 2))
        await _wait_for(functools.partial(placed, "late"))
        urgent = asyncio.create_task(run("urgent", -5, 2))
        await _wait_for(functools.partial(placed, "urgent"))
        assert not queued[-1].done(), "the long requests ended before the others queued"
        await asyncio.wait_for(asyncio.gather(first, *queued, late, urgent), timeout=90)

    asyncio.run(main())
    assert started == ["first", "queued-0", "queued-1", "urgent", "late"]


def _hold_the_cpu_in_the_next_step(actor: object, seconds: float) -> None:
    """Make the worker's next engine step spin on the CPU for ``seconds`` first (holding the
    engine's lock, and the GIL but for the interpreter's switches), as a step slowed by a busy
    machine, a long prompt or a grammar compile would."""

    def install(actor_self: object, seconds: float) -> None:
        engine = actor_self.worker.loop.engine  # type: ignore[attr-defined]
        step = engine.step

        def held_step() -> object:
            engine.step = step
            actor_self.held_s = 0.0  # type: ignore[attr-defined]
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                pass
            actor_self.held_s = time.monotonic() - started  # type: ignore[attr-defined]
            return step()

        engine.step = held_step

    ray.get(actor.__ray_call__.remote(install, seconds))  # type: ignore[attr-defined]


@pytest.mark.parametrize("slow_worker", ["prefill-0", "decode-0"])
def test_a_worker_whose_step_holds_the_cpu_for_8_s_stays_in_rotation(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],  # type: ignore[no-untyped-def]
    slow_worker: str,
) -> None:
    """Slow is not dead. One step of a worker spins for 8 s, longer than the 5 s after which
    the router used to take a worker out when a load report was late (its report waited for
    the step; one prefill worker out answered 503 to a healthy cluster). With the default
    ``dead_after_s``, the worker stays in rotation the whole time, the cluster stays ready,
    and every request completes token for token as the offline engine."""
    config = local_cluster_config(llama_dir, num_prefill=1, num_decode=1)
    assert config.dead_after_s >= 10.0  # the default: tests set none of their own
    cluster = start_cluster(config)
    actor = cluster.pool.workers[slow_worker].actor
    _hold_the_cpu_in_the_next_step(actor, 8.0)
    not_ready: list[float] = []
    prompts, params = _workload()

    async def main() -> list[list[int]]:
        tasks = [asyncio.create_task(_collect(cluster, p, s)) for p, s in zip(prompts, params)]
        while not all(task.done() for task in tasks):
            if not cluster.is_ready():
                not_ready.append(time.monotonic())
            await asyncio.sleep(0.05)
        return [task.result() for task in tasks]

    assert asyncio.run(main()) == expected
    held_s = ray.get(actor.__ray_call__.remote(lambda actor_self: actor_self.held_s))
    assert held_s >= 8.0  # the step did hold the CPU
    assert not not_ready
    assert all(status.alive for status in cluster.worker_statuses())


def _long_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = make_prompts(seed=35) + make_prompts(seed=36)
    params = [
        SamplingParams(temperature=0.0, max_tokens=60 + 5 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


@pytest.fixture(scope="module")
def expected_long(llama_dir: Path) -> list[list[int]]:
    prompts, params = _long_workload()
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _num_decoding_on(cluster: Cluster, worker_id: str) -> int:
    return sum(
        t.decode_worker == worker_id and t.started_decoding
        for t in cluster.placements.open_trackers()
    )


def _num_queued_on(cluster: Cluster, worker_id: str) -> int:
    """Requests placed on prefill worker ``worker_id`` whose first token is not out yet."""
    return sum(
        t.prefill_worker == worker_id and not t.delivered
        for t in cluster.placements.open_trackers()
    )


def test_killed_decode_worker_requests_finish_elsewhere_exactly_once(
    start_cluster,
    llama_dir: Path,
    expected_long: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    cluster = start_cluster(local_cluster_config(llama_dir, num_prefill=1, num_decode=2))
    prompts, params = _long_workload()

    async def main() -> list[list[int]]:
        tasks = [asyncio.create_task(_collect(cluster, p, s)) for p, s in zip(prompts, params)]
        await _wait_for(lambda: _num_decoding_on(cluster, "decode-1") >= 3)
        ray.kill(cluster.pool.workers["decode-1"].actor)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=90))

    assert asyncio.run(main()) == expected_long
    assert not cluster.pool.workers["decode-1"].alive


def test_killed_prefill_worker_queued_requests_are_rerouted(
    start_cluster,
    llama_dir: Path,
    expected_long: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    config = local_cluster_config(llama_dir, num_prefill=2, num_decode=1, max_num_batched_tokens=8)
    cluster = start_cluster(config)
    prompts, params = _long_workload()

    async def main() -> list[list[int]]:
        tasks = [asyncio.create_task(_collect(cluster, p, s)) for p, s in zip(prompts, params)]
        await _wait_for(lambda: cluster.placements.num_open() == len(prompts))
        await _wait_for(lambda: not any(t.placing for t in cluster.placements.open_trackers()))
        assert _num_queued_on(cluster, "prefill-0") >= 1
        ray.kill(cluster.pool.workers["prefill-0"].actor)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=90))

    assert asyncio.run(main()) == expected_long
    assert not cluster.pool.workers["prefill-0"].alive


def test_a_decode_and_a_prefill_worker_killed_together_lose_and_duplicate_nothing(
    start_cluster,
    llama_dir: Path,
    expected_long: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    """2P2D under load: decode-1 dies with sequences decoding on it, prefill-0 at the same
    moment with prompts queued on it. Every request ends exactly as the offline engine's
    output: no token lost, none twice, none out of order."""
    config = local_cluster_config(llama_dir, num_prefill=2, num_decode=2, max_num_batched_tokens=8)
    cluster = start_cluster(config)
    prompts, params = _long_workload()

    async def main() -> list[list[int]]:
        tasks = [asyncio.create_task(_collect(cluster, p, s)) for p, s in zip(prompts, params)]
        await _wait_for(
            lambda: (
                _num_decoding_on(cluster, "decode-1") >= 2
                and _num_queued_on(cluster, "prefill-0") >= 1
            ),
            timeout_s=60,
        )
        for worker_id in ("decode-1", "prefill-0"):
            ray.kill(cluster.pool.workers[worker_id].actor)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=120))

    assert asyncio.run(main()) == expected_long
    assert not cluster.pool.workers["decode-1"].alive
    assert not cluster.pool.workers["prefill-0"].alive


def test_killed_workers_are_replaced_and_the_new_pair_serves_exactly(
    start_cluster,
    llama_dir: Path,
    expected: list[list[int]],  # type: ignore[no-untyped-def]
) -> None:
    """A pool of one loses its worker: a new one starts in its slot (a new actor, a new id),
    and requests are served exactly again, the KV handed off over channels to the new worker;
    then the same for the prefill pool's only worker, whose replacement must know the decode
    worker that joined before it. Before, the cluster answered nothing until restarted."""
    cluster = start_cluster(
        local_cluster_config(llama_dir, num_prefill=1, num_decode=1, restart_delay_s=0.0)
    )

    def in_rotation(worker_id: str) -> bool:
        return any(
            s.worker_id == worker_id and s.alive and s.load for s in cluster.worker_statuses()
        )

    for dead, new in (("decode-0", "decode-0-r1"), ("prefill-0", "prefill-0-r1")):
        ray.kill(cluster.pool.workers[dead].actor)
        asyncio.run(_wait_for(functools.partial(in_rotation, new), timeout_s=120))
        assert not cluster.pool.workers[dead].alive and cluster.is_ready()
        assert _run_all(cluster) == expected
    transports = _channel_transports(cluster.pool.workers["prefill-0-r1"].actor)
    assert transports == {"decode-0-r1": "shm"}


def _constrained_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Long outputs under two grammars (never whole before max_tokens: each decodes on)."""
    from engine.structured.spec import StructuredOutputSpec

    specs = [
        StructuredOutputSpec(regex="[a-z ]{300}"),
        StructuredOutputSpec(regex="([0-9]+,){150}"),
    ]
    prompts = make_prompts(seed=37) + make_prompts(seed=38)
    params = [
        SamplingParams(temperature=0.0, max_tokens=50 + 5 * i, structured_outputs=specs[i % 2])
        for i in range(len(prompts))
    ]
    return prompts, params


def test_constrained_requests_resume_elsewhere_in_their_grammar(
    start_cluster,
    llama_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A decode worker dies mid-output: its structured-output requests resume on the other one,
    which finds each grammar state by replaying the tokens already sent; the outputs are the
    offline engine's."""
    prompts, params = _constrained_workload()
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    cluster = start_cluster(local_cluster_config(llama_dir, num_prefill=1, num_decode=2))

    async def main() -> list[list[int]]:
        tasks = [asyncio.create_task(_collect(cluster, p, s)) for p, s in zip(prompts, params)]
        await _wait_for(lambda: _num_decoding_on(cluster, "decode-1") >= 3)
        ray.kill(cluster.pool.workers["decode-1"].actor)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=90))

    assert asyncio.run(main()) == expected
    assert not cluster.pool.workers["decode-1"].alive
