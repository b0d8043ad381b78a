"""A router over workers whose engines run in this process: each fake actor (``fake_actors``)
holds a real ``EngineLoop`` on the tiny Llama, and its output stream is the loop's. The router's
threads (placements, output pumps) and the workers' engine loops run for real; only Ray is left
out (``use_fake_ray`` must be in effect). A prefill worker runs prompts to their first token and
keeps their KV: nothing is handed off, so only first tokens come from it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.kv_cache.budget import KVBudget
from engine.llm_engine import LLMEngine
from engine.messages import GenerateRequest, KVCursor, OutputBatch, WorkerLoad
from engine.scheduler import SchedulerConfig
from router.cluster import Cluster, WorkerHandle
from router.cluster_config import ClusterConfig
from tests.router.fake_actors import FakeActor, Ref


class LoopActor(FakeActor):
    """A fake actor whose requests run on an engine loop of its own."""

    def __init__(self, worker_id: str, role: str, loop: EngineLoop) -> None:
        super().__init__(worker_id, role)
        self.loop = loop

    def do_submit(self, request: GenerateRequest, decode_id: str | None = None) -> bool:
        super().do_submit(request, decode_id)
        return self.loop.submit(request, prefill_only=decode_id is not None)

    def do_abort(self, request_id: str) -> None:
        super().do_abort(request_id)
        self.loop.abort(request_id)

    def do_load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        return self.loop.load(kv_cursor=kv_cursor)

    @property
    def stream(self) -> _LoopStream:
        return _LoopStream(self.loop)


class _LoopStream:
    """``actor.stream.options(...).remote(gateway_id)``: the loop's batches, as references."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def options(self, **options: Any) -> _LoopStream:
        return self

    def remote(self, gateway_id: str) -> Iterator[Ref]:
        for batch in self.loop.stream(gateway_id):
            yield Ref(functools.partial(_same, batch))


def _same(batch: OutputBatch) -> OutputBatch:
    return batch


@dataclass
class LoopCluster:
    cluster: Cluster
    actors: dict[str, LoopActor]

    def stop(self) -> None:
        """Stop the loops, which ends their streams and the pump threads reading them."""
        self.cluster.pool.stopping.set()
        for actor in self.actors.values():
            actor.loop.stop()


def loop_cluster(
    model_dir: Path,
    num_prefill: int,
    num_kv_blocks: int = 256,
    kv_offload_gb: float = 0.0,
    **config: Any,
) -> LoopCluster:
    """``num_prefill`` prefill workers (0: colocated) and one decode worker, each on an engine
    loop over ``model_dir`` with a cache of ``num_kv_blocks`` blocks of 8 tokens (and a host
    tier of ``kv_offload_gb``); the output pumps run, the load monitor does not."""
    actors: dict[str, LoopActor] = {}
    for role, worker_id in [("decode", "decode-0")] + [
        ("prefill", f"prefill-{i}") for i in range(num_prefill)
    ]:
        engine = LLMEngine(
            LoadConfig(str(model_dir), dtype="float32", device="cpu"),
            CacheConfig(
                block_size=8,
                budget=KVBudget(num_blocks=num_kv_blocks),
                kv_offload_gb=kv_offload_gb,
            ),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
            record_kv_events=True,
        )
        loop = EngineLoop(engine, worker_id)
        loop.start()
        actor = actors[worker_id] = LoopActor(worker_id, role, loop)
        if role == "prefill":
            actor.peers = {"decode-0": actors["decode-0"]}
    handles = [WorkerHandle(a.worker_id, a.role, a) for a in actors.values()]
    handles.sort(key=lambda w: w.role != "prefill")
    config.setdefault("block_size", 8)  # the engines' (the router hashes prompts alike)
    cluster_config = ClusterConfig(
        model_dir=str(model_dir), num_prefill=num_prefill, num_decode=1, **config
    )
    cluster = Cluster(cluster_config, handles)
    cluster.poll()
    for worker in cluster.pool.workers.values():
        cluster.pump.start(worker)
    return LoopCluster(cluster, actors)
