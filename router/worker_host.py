"""A worker of either role that can change role in place (``WorkerHost``), and what it runs
(``WorkerSpec``): the body of the cluster's worker actors (router/actors.py), without Ray.

The worker classes (and torch) are imported when a worker is built, so this module, like the
rest of the router, imports without torch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kv_cache.kv_quantization import KVCacheScales
from engine.messages import (
    DecodePeer,
    GenerateRequest,
    HandoffCall,
    KVCursor,
    OutputBatch,
    WorkerLoad,
)
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import TransferConfig
from kv_transfer.rank_calls import RankPeer

if TYPE_CHECKING:  # (imported where a worker is built: they import torch)
    from decode_worker.worker import DecodeWorker
    from engine.parallel.rank_model import LoadedWeights
    from prefill_worker.worker import PrefillWorker

logger = logging.getLogger(__name__)
T = TypeVar("T")
# a prefill worker's decode peers from their handles, by decode worker id
DecodePeersOf = Callable[[Mapping[str, Any]], Mapping[str, DecodePeer]]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """The worker an actor runs: its role, its id and its configs (the launcher's, per role)."""

    role: str  # "prefill" | "decode"
    worker_id: str
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    transfer: TransferConfig
    parallel: ParallelConfig | None = None  # None: one rank
    # a decode worker's; a prefill worker's for a prediction layer's KV (it never drafts)
    speculative: SpeculativeConfig | None = None
    # a prefill worker's: the decode workers it hands off to (by id), and each one's ranks
    decode_handles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    decode_tp: int = 1

    @property
    def num_ranks(self) -> int:
        return 1 if self.parallel is None else self.parallel.tensor_parallel_size


@dataclass(frozen=True, slots=True)
class RoleChange:
    """A worker's change of role in place, as its host reports it."""

    worker_id: str  # its id in its new role
    stop_s: float  # the old role's worker stopping (its loop, hand-offs, channels)
    build_s: float  # the new role's worker built on the weights (and KV cache) kept

    def describe(self) -> str:
        return f"the old worker stopped in {self.stop_s:.2f} s, the new one built in {self.build_s:.2f} s"


class WorkerHost:
    """A prefill or a decode worker (``spec.role``) that can become a worker of the other role
    in place (``change_role``, for router/rebalancer.py): the model's weights stay in memory,
    the engine and its KV cache are built anew for the new role. Every call a worker of either
    role answers goes through it; a call for the other role is refused, naming the worker.
    The cluster's actor (router/actors.py: ``WorkerActor``) is one, in a process of its own."""

    def __init__(
        self,
        spec: WorkerSpec,
        follower_ranks: Sequence[RankPeer] = (),  # its ranks 1 .. N-1's KV ports, in order
        decode_peers: DecodePeersOf = dict,  # a prefill worker's handles -> its peers
    ) -> None:
        self.spec = spec
        self._decode_peers = decode_peers
        self._follower_ranks = list(follower_ranks)  # (they follow it into its next role)
        self._role_lock = threading.Lock()  # held while it changes role
        self._worker: PrefillWorker | DecodeWorker | None = build_worker(
            spec, follower_ranks, decode_peers, None
        )

    # ---- either role ----------------------------------------------------------------------
    def ready(self) -> str:
        return self.worker.worker_id

    def profile_latency(self) -> int:
        """Run the start-up latency profile (engine/latency_profile.py); the steps it ran."""
        from engine.latency_profile import run_latency_profile_in_loop

        return run_latency_profile_in_loop(self.worker.loop)

    def kv_cache_scales(self) -> KVCacheScales | None:
        """Its quantized cache's scales (the cluster hands them to every other worker)."""
        return self.worker.engine.kv_cache_scales

    def submit(
        self, request: GenerateRequest, decode_worker_id: str | None = None, fetch_blocks: int = 0
    ) -> bool:
        """Queue a request: on a decode worker (colocated, or a resume) without
        ``decode_worker_id``; on a prefill worker with the decode worker it hands off to. False
        when a decode worker runs it already."""
        if decode_worker_id is None:
            return self._decode().submit(request)
        self._prefill().submit(request, decode_worker_id, fetch_blocks)
        return True

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        return self.worker.load(kv_cursor)

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        """A gateway's outputs from the worker it runs now, until that worker stops (a change
        of role ends it: the outputs of the new worker are read under its own id)."""
        yield from self.worker.stream(gateway_id)

    def shutdown(self) -> None:
        with self._role_lock:
            if self._worker is not None:
                self._worker.shutdown()

    def change_role(self, spec: WorkerSpec, keep_kv_cache: bool = True) -> RoleChange:
        """Stop the worker it runs (what that one still holds is lost: its requests were moved
        elsewhere first) and run ``spec``'s, of the other role, on the same weights; how long
        each part took. ``keep_kv_cache``: the new worker takes the old one's KV cache where it
        has its shape -- only when no hand-off or prefix copy may still be writing to it (the
        worker drained: each request on it ended); else the cache is allocated anew. A
        tensor-parallel worker's ranks change with it, on the group they run (each rebuilds on
        its own shard), so the new role's worker has as many ranks."""
        if spec.num_ranks != self.spec.num_ranks:
            raise ValueError(
                f"a worker of {self.spec.num_ranks} ranks changes role in place only to a worker "
                f"of as many, not {spec.num_ranks} (--prefill-tp and --decode-tp must match)"
            )
        spec = dataclasses.replace(spec, parallel=self.spec.parallel)  # its ranks' own group
        with self._role_lock:
            began = time.perf_counter()
            leaving, self._worker = self._worker, None
            if leaving is None:
                raise RuntimeError(f"{self.spec.worker_id} has stopped")
            weights = leaving.engine.keep_for_next_role(keep_kv_cache)
            leaving.shutdown()  # (its followers run on: their group is the weights')
            del leaving  # (freed by the new engine's build where it needs the memory)
            stopped = time.perf_counter()
            worker = build_worker(spec, self._follower_ranks, self._decode_peers, weights)
            self.spec = spec  # (first: a call that finds the new worker reads its role)
            self._worker = worker
        change = RoleChange(spec.worker_id, stopped - began, time.perf_counter() - stopped)
        logger.warning("now %s worker %s (%s)", spec.role, spec.worker_id, change.describe())
        return change

    @property
    def worker(self) -> PrefillWorker | DecodeWorker:
        """The worker it runs now; RuntimeError while it changes role."""
        worker = self._worker
        if worker is None:
            raise RuntimeError(f"{self.spec.worker_id} is changing role")
        return worker

    # ---- a decode worker ------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        """Whether its decode worker runs the request (a prefill worker runs none to the end)."""
        worker = self.worker
        return self.spec.role == "decode" and cast("DecodeWorker", worker).has_request(request_id)

    def handoff(self, call: HandoffCall[T]) -> T:
        """Answer a prefill worker's hand-off call (sent by ``RayDecodePeer``)."""
        return call.run_on(self._decode())

    def _decode(self) -> DecodeWorker:
        worker = self.worker
        if self.spec.role != "decode":
            raise RuntimeError(f"{worker.worker_id} is a prefill worker, not a decode worker")
        return cast("DecodeWorker", worker)

    # ---- a prefill worker -----------------------------------------------------------------
    def retarget(self, request_id: str, decode_worker_id: str) -> bool:
        return self._prefill().retarget(request_id, decode_worker_id)

    def add_decode_peers(self, decode_handles: Mapping[str, Any]) -> None:
        self._prefill().add_decode_peers(self._decode_peers(decode_handles))

    def forget_decode_peer(self, decode_worker_id: str) -> None:
        worker = self.worker
        if self.spec.role == "prefill":  # (a decode worker has no decode peers)
            cast("PrefillWorker", worker).forget_decode_peer(decode_worker_id)

    def rejoin(self, decode_handles: Mapping[str, Any]) -> WorkerLoad:
        """Learn the decode workers that joined while this one was out of rotation (stalled),
        then report load: the router's probe before it takes this worker back."""
        self.add_decode_peers(decode_handles)
        return self._prefill().load()

    def _prefill(self) -> PrefillWorker:
        worker = self.worker
        if self.spec.role != "prefill":
            raise RuntimeError(f"{worker.worker_id} is a decode worker, not a prefill worker")
        return cast("PrefillWorker", worker)


def build_worker(
    spec: WorkerSpec,
    follower_ranks: Sequence[RankPeer],
    decode_peers: DecodePeersOf,
    weights: LoadedWeights | None,
) -> PrefillWorker | DecodeWorker:
    """``spec``'s worker, on ``weights`` if given (the worker classes, and torch, are imported
    here only: the router runs without torch)."""
    if spec.role == "decode":
        from decode_worker.worker import DecodeWorker

        return DecodeWorker(
            spec.worker_id,
            spec.load,
            spec.cache,
            spec.scheduler,
            spec.transfer,
            spec.speculative,
            spec.parallel,
            follower_ranks,
            weights,
        )
    from prefill_worker.worker import PrefillWorker

    return PrefillWorker(
        spec.worker_id,
        spec.load,
        spec.cache,
        spec.scheduler,
        spec.transfer,
        decode_peers(spec.decode_handles),
        spec.parallel,
        follower_ranks,
        spec.decode_tp,
        weights,
        spec.speculative,
    )
