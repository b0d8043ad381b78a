"""The KV hand-off between a prefill worker and a decode worker of different tensor-parallel
sizes, on Ray: each decode rank receives exactly the KV heads it holds, over a channel per rank
pair, and the cluster serves greedy requests exactly as the offline engine of one rank does; a
decode rank that dies under load takes its worker out, and every request finishes elsewhere,
each token once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from engine import SamplingParams
from engine.model_config import load_model_config
from router.cluster import Cluster
from tests.cluster.tp_workload import (
    NUM_REQUESTS,
    all_running,
    followers,
    offline_tokens,
    random_prompts,
    run_all,
    run_all_killing,
)
from tests.fixtures.local_cluster import local_cluster_config
from tests.fixtures.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts(seed=37)


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    return offline_tokens(llama_dir, PROMPTS, PARAMS, BLOCK_SIZE)


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, ray_session: None, llama_dir: Path
) -> Iterator[Cluster]:
    prefill_tp, decode_tp, num_decode, failure_policy = request.param
    config = local_cluster_config(
        llama_dir,
        num_prefill=1,
        num_decode=num_decode,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        block_size=BLOCK_SIZE,
        restart_delay_s=0.2,
        failure_policy=failure_policy,
    )
    started = Cluster.start(config)
    yield started
    started.shutdown()


def _on(actor: Any, fn: Any) -> Any:
    return ray.get(actor.__ray_call__.remote(fn))


def _kv_heads(actor: Any) -> tuple[range, ...]:
    """The KV heads of each of a worker's ranks, as its rank 0 reports them."""
    return tuple(_on(actor, lambda self: self.worker._kv_heads))


def _received(actor: Any) -> tuple[int, int]:
    """(transfers, bytes) a decode worker received."""
    transfers, nbytes, _ = _on(actor, lambda self: self.worker._transfer_totals.snapshot())
    return transfers, nbytes


def _whole_kv_bytes(model_dir: Path) -> int:
    """Bytes of every prompt's KV, all KV heads once (float32)."""
    model = load_model_config(str(model_dir))
    block_bytes = model.num_layers * 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * 4
    return sum(-(-len(p) // BLOCK_SIZE) * block_bytes for p in PROMPTS)


@pytest.mark.parametrize(
    ("cluster", "heads"),
    [
        # "fail": a request whose KV did not arrive fails, never recomputes unseen
        ((1, 2, 1, "fail"), ((range(0, 2),), (range(0, 1), range(1, 2)))),
        ((2, 1, 1, "fail"), ((range(0, 1), range(1, 2)), (range(0, 2),))),
        ((2, 2, 1, "fail"), ((range(0, 1), range(1, 2)), (range(0, 1), range(1, 2)))),
    ],
    indirect=["cluster"],
    ids=["P-tp1-D-tp2", "P-tp2-D-tp1", "P-tp2-D-tp2"],
)
def test_workers_of_different_sizes_hand_off_each_rank_its_heads(
    cluster: Cluster,
    heads: tuple[tuple[range, ...], tuple[range, ...]],
    expected: list[list[int]],
    llama_dir: Path,
) -> None:
    prefill = cluster.pool.workers["prefill-0"]
    decode = cluster.pool.workers["decode-0"]
    assert (_kv_heads(prefill.actor), _kv_heads(decode.actor)) == heads
    assert run_all(cluster, PROMPTS, PARAMS) == expected
    # every request's KV arrived (none recomputed), each head of each block exactly once
    assert _received(decode.actor) == (NUM_REQUESTS, _whole_kv_bytes(llama_dir))


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of one KV head: every rank of a worker of TP 2 holds it (replicated)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("mqa"), "LlamaForCausalLM", seed=11, num_key_value_heads=1
    )


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"),
    [(1, 2), (2, 1), (2, 2)],
    ids=["P-tp1-D-tp2", "P-tp2-D-tp1", "P-tp2-D-tp2"],
)
def test_a_replicated_kv_head_reaches_each_decode_rank_once(
    ray_session: None, mqa_dir: Path, prefill_tp: int, decode_tp: int
) -> None:
    """One KV head, held by every rank of a TP-2 worker: each decode rank receives it once
    (from one of the prefill ranks that hold it), and the cluster decodes what the offline
    engine of one rank does."""
    config = local_cluster_config(
        mqa_dir,
        num_prefill=1,
        num_decode=1,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        block_size=BLOCK_SIZE,
        failure_policy="fail",  # a request whose KV did not arrive fails, never recomputes
    )
    cluster = Cluster.start(config)
    try:
        prefill = cluster.pool.workers["prefill-0"]
        decode = cluster.pool.workers["decode-0"]
        assert _kv_heads(prefill.actor) == (range(0, 1),) * prefill_tp
        assert _kv_heads(decode.actor) == (range(0, 1),) * decode_tp
        expected = offline_tokens(mqa_dir, PROMPTS, PARAMS, BLOCK_SIZE)
        assert run_all(cluster, PROMPTS, PARAMS) == expected
        # every request's KV arrived; each decode rank got the one head of each block once
        assert _received(decode.actor) == (NUM_REQUESTS, decode_tp * _whole_kv_bytes(mqa_dir))
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("cluster", [(1, 2, 2, "recompute")], indirect=True)
def test_a_lost_decode_rank_under_load_loses_no_request(
    cluster: Cluster, expected: list[list[int]]
) -> None:
    victim = cluster.pool.workers["decode-0"]
    (follower,) = followers(victim.actor)
    # kill decode-0's follower rank once both decode workers are streaming tokens
    killed_while_running, outputs = run_all_killing(
        cluster, PROMPTS, PARAMS, follower, lambda c: all_running(c, "decode", 2)
    )
    assert killed_while_running
    assert outputs == expected  # every request complete, each token once
    assert not cluster.pool.workers["decode-0"].alive


def test_a_lost_prefill_rank_takes_its_worker_out_and_no_request_is_lost(
    ray_session: None, llama_dir: Path, expected: list[list[int]]
) -> None:
    config = local_cluster_config(
        llama_dir,
        num_prefill=2,
        num_decode=1,
        prefill_tp=2,
        block_size=BLOCK_SIZE,
        restart_delay_s=0.2,
    )
    cluster = Cluster.start(config)
    try:
        victim = cluster.pool.workers["prefill-0"]
        (follower,) = followers(victim.actor)
        # its rank 0 learns at its next step, which the requests routed to it start: that step
        # fails in a collective, the worker's process leaves, and the router places them again
        ray.kill(follower)
        # every request complete, each token once
        assert run_all(cluster, PROMPTS, PARAMS) == expected
        deadline = time.monotonic() + 120
        while "prefill-0-r1" not in cluster.pool.workers and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cluster.pool.workers["prefill-0"].alive
        assert _kv_heads(cluster.pool.workers["prefill-0-r1"].actor) == (range(0, 1), range(1, 2))
    finally:
        cluster.shutdown()


def _held_experts(actor: Any) -> list[range]:
    """The routed experts each sparse layer of a worker's rank 0 holds."""
    from engine.models.moe import RoutedExperts

    def held(self: Any) -> list[range]:
        modules = self.worker.engine.model.modules()
        return [m.held for m in modules if isinstance(m, RoutedExperts)]

    return list(_on(actor, held))


def test_expert_parallel_workers_serve_what_one_rank_does(
    ray_session: None, model_dirs: dict[str, Path]
) -> None:
    """Qwen2-MoE (eight experts and a shared one) on a prefill and a decode worker of two
    ranks each, their experts dealt out whole (``--enable-expert-parallel``): every rank 0
    holds experts 0-3, the KV hand-off is the plain one's, and 32 concurrent greedy requests
    get the offline engine's tokens at one rank."""
    model_dir = model_dirs["Qwen2MoeForCausalLM"]
    config = local_cluster_config(
        model_dir,
        num_prefill=1,
        num_decode=1,
        prefill_tp=2,
        decode_tp=2,
        expert_parallel=True,
        block_size=BLOCK_SIZE,
        failure_policy="fail",  # a request whose KV did not arrive fails, never recomputes
    )
    assert config.parallel_config("decode").expert_parallel
    cluster = Cluster.start(config)
    try:
        prefill = cluster.pool.workers["prefill-0"]
        decode = cluster.pool.workers["decode-0"]
        for actor in (prefill.actor, decode.actor):
            runs = _held_experts(actor)  # each sparse layer's
            assert runs and set(runs) == {range(0, 4)}
        expected = offline_tokens(model_dir, PROMPTS, PARAMS, BLOCK_SIZE)
        assert run_all(cluster, PROMPTS, PARAMS) == expected
        assert _received(decode.actor) == (NUM_REQUESTS, _whole_kv_bytes(model_dir))
    finally:
        cluster.shutdown()
