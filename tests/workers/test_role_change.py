"""A worker changes role in its own process (``WorkerHost.change_role``, what ``--rebalance``
does): its weights stay in memory, its KV cache too where the new role's has its shape (else it
is freed), and the new role's worker serves exactly what the offline engine gives -- a prefill
worker that became a decode worker decodes hand-offs and runs requests of its own, and a decode
worker that became a prefill worker hands off to it. Both run in this process, without Ray (the
cluster's actors are these hosts in processes of their own): a prefill worker's decode peer
calls the host's ``handoff`` on a thread pool."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget
from engine.messages import HandoffCall, OutputBatch
from engine.scheduler import SchedulerConfig
from kv_transfer.policy import TransferConfig
from router.worker_host import WorkerHost, WorkerSpec
from tests.engine.test_parity import make_prompts
from tests.workers.output_collector import OutputCollector

GATEWAY = "test-gateway"
pytestmark = pytest.mark.timeout(300)


class _HostPeer:
    """A prefill worker's peer on a decode worker's host in this process: each hand-off call
    runs on a thread of the pool, on whichever worker the host runs then (as a Ray handle's
    call runs on its actor)."""

    def __init__(self, host: WorkerHost, pool: ThreadPoolExecutor) -> None:
        self.host, self.pool = host, pool

    def send(self, call: HandoffCall[Any]) -> Future[Any]:
        return self.pool.submit(self.host.handoff, call)


def _spec(
    model_dir: Path, role: str, worker_id: str, num_blocks: int = 300, **decode: Any
) -> WorkerSpec:
    return WorkerSpec(
        role,
        worker_id,
        LoadConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=8, budget=KVBudget(num_blocks=num_blocks)),
        SchedulerConfig(max_num_batched_tokens=128),
        TransferConfig(transport="gloo", host="127.0.0.1", timeout_s=10.0),
        **decode,
    )


def _outputs(actor: WorkerHost) -> Callable[[str, float], OutputBatch | None]:
    """The collector's source: the batches of whichever worker the actor runs now."""

    def next_batch(gateway_id: str, timeout_s: float) -> OutputBatch | None:
        try:
            return actor.worker.next_batch(gateway_id, timeout_s)
        except RuntimeError:  # changing role
            time.sleep(timeout_s)
            return None

    return next_batch


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8, thread_name_prefix="handoff-calls") as executor:
        yield executor


def test_workers_change_role_in_place_and_serve_as_the_offline_engine(
    llama_dir: Path, pool: ThreadPoolExecutor
) -> None:
    prompts = [*make_prompts(seed=31), *make_prompts(seed=32)][:12]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 9) for i in range(12)]
    offline = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]

    def peers(hosts: Mapping[str, Any]) -> dict[str, _HostPeer]:
        return {worker_id: _HostPeer(host, pool) for worker_id, host in hosts.items()}

    decode = WorkerHost(_spec(llama_dir, "decode", "decode-0"), decode_peers=peers)
    first = WorkerHost(
        _spec(llama_dir, "prefill", "prefill-0", decode_handles={"decode-0": decode}),
        decode_peers=peers,
    )
    collector = OutputCollector([_outputs(decode), _outputs(first)], GATEWAY)
    try:

        def run(ids: range, submit: Callable[[GenerateRequest], object]) -> None:
            for i in ids:
                submit(GenerateRequest(f"r{i}", prompts[i], params[i], GATEWAY))
            collector.wait_finished([(f"r{i}", 0) for i in ids], whole=True)
            assert not collector.failures
            assert [collector.output(f"r{i}") for i in ids] == expected[ids.start : ids.stop]

        run(range(0, 4), lambda r: first.submit(r, "decode-0"))  # prefill-0 -> decode-0

        # prefill-0 becomes decode-1: the same weights, and its KV cache (of the same shape)
        model, cache = first.worker.engine.model, first.worker.engine.kv_cache
        change = first.change_role(_spec(llama_dir, "decode", "decode-1"))
        assert change.worker_id == "decode-1" and min(change.stop_s, change.build_s) > 0
        assert first.ready() == "decode-1" and first.worker.engine.model is model
        assert first.worker.engine.kv_cache is cache
        del cache
        run(range(4, 7), first.submit)  # decode-1 runs requests of its own

        # decode-0 becomes prefill-1, of a smaller cache: its old one is freed; it hands off
        # to decode-1
        old_cache = weakref.ref(decode.worker.engine.kv_cache)
        prefill_spec = _spec(
            llama_dir, "prefill", "prefill-1", 200, decode_handles={"decode-1": first}
        )
        assert decode.change_role(prefill_spec).worker_id == "prefill-1"
        assert decode.worker.engine.kv_cache.shape[2] == 200
        deadline = time.monotonic() + 30
        while old_cache() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
        assert old_cache() is None, "the old role's KV cache outlived the change"
        run(range(7, 12), lambda r: decode.submit(r, "decode-1"))
        assert collector.num_duplicates == 0
    finally:
        collector.close()
        first.shutdown()
        decode.shutdown()


def test_calls_for_the_other_role_are_refused_by_name(llama_dir: Path) -> None:
    actor = WorkerHost(_spec(llama_dir, "decode", "decode-0"))
    try:
        request = GenerateRequest("r", [5, 6, 7], SamplingParams(max_tokens=2), GATEWAY)
        with pytest.raises(RuntimeError, match="decode-0 is a decode worker, not a prefill"):
            actor.submit(request, "decode-9")
        actor.change_role(_spec(llama_dir, "prefill", "prefill-3"))
        with pytest.raises(RuntimeError, match="prefill-3 is a prefill worker, not a decode"):
            actor.submit(request)
        assert not actor.has_request("r")
        actor.forget_decode_peer("decode-0")  # (what the router asks of every prefill worker)
    finally:
        actor.shutdown()
