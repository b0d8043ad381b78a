"""Worker actors and ``ray.get`` stand-ins for driving ``router.cluster.Cluster`` without Ray.

An actor method's ``.remote(...)`` records the call and returns a reference whose ``ray.get``
runs it: a dead actor raises ``RayActorError``, a stalled one ``GetTimeoutError``. The actors
keep only what routing needs: which requests they hold, where a prefill hands each off, and
which decode workers a prefill one knows (as the real one, it refuses a request for another).
``FakeLauncher`` starts such actors in place of dead ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import ray

import router.cluster
import router.output_pump
import router.placements
import router.worker_pool
from engine.messages import GenerateRequest, KVCursor, TokenEvent, WorkerLoad
from engine.sampling.params import SamplingParams
from router.cluster import Cluster, WorkerHandle
from router.cluster_config import ClusterConfig
from router.request_tracker import ClientItem, RequestTracker
from router.worker_slots import WorkerSlot


class Ref:
    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call


class FakeRay:
    """What ``router.cluster`` uses of the ``ray`` module."""

    exceptions = ray.exceptions

    @staticmethod
    def wait(
        refs: list[Ref], num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Ref], list[Ref]]:
        return refs, []  # every call is answered at once (or raises when got)

    @staticmethod
    def kill(actor: FakeActor) -> None:
        actor.dead = True

    @staticmethod
    def get(ref: Ref | list[Ref], timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            return [r.call() for r in ref]
        try:
            return ref.call()
        except ray.exceptions.GetTimeoutError:
            time.sleep(timeout or 0.0)  # a stalled actor: the caller waits its whole timeout
            raise


def use_fake_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the router's parts call ``FakeRay`` instead of Ray."""
    for module in (router.cluster, router.worker_pool, router.placements, router.output_pump):
        monkeypatch.setattr(module, "ray", FakeRay)


class _Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def options(self, **options: Any) -> _Method:
        return self  # (the output stream's): its remote() below

    def remote(self, *args: Any) -> Any:
        if self.name == "stream":  # an output stream that ends at once: tests dispatch batches
            return iter(())
        actor, name = self.actor, self.name
        actor.calls.append((name, args))

        def run() -> Any:
            if actor.dead:
                raise ray.exceptions.RayActorError()
            if actor.stalled:
                raise ray.exceptions.GetTimeoutError()
            return getattr(actor, f"do_{name}")(*args)

        return Ref(run)


class FakeActor:
    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id, self.role = worker_id, role
        self.dead = False
        self.stalled = False
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.requests: dict[str, GenerateRequest] = {}  # held, by id
        self.targets: dict[str, str] = {}  # prefill: request id -> decode worker
        self.peers: dict[str, Any] = {}  # prefill: the decode workers it knows, by id
        self.fails_to_start = False  # its ready call fails (as a constructor that raised)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or name.startswith("do_"):
            raise AttributeError(name)
        return _Method(self, name)

    def aborts(self) -> list[str]:
        return [args[0] for name, args in self.calls if name == "abort"]

    def do_ready(self) -> str:
        if self.fails_to_start:
            raise ray.exceptions.RayActorError()
        return self.worker_id

    def do_add_decode_peers(self, handles: dict[str, Any]) -> None:
        self.peers = {**handles, **self.peers}

    def do_forget_decode_peer(self, decode_id: str) -> None:
        self.peers.pop(decode_id, None)

    def do_rejoin(self, handles: dict[str, Any]) -> WorkerLoad:
        self.do_add_decode_peers(handles)
        return self.do_load()

    def do_submit(self, request: GenerateRequest, decode_id: str | None = None) -> bool:
        if decode_id is not None and decode_id not in self.peers:
            raise ValueError(f"unknown decode worker {decode_id!r}")
        new = request.request_id not in self.requests
        self.requests[request.request_id] = request
        if decode_id is not None:
            self.targets[request.request_id] = decode_id
        return new

    def do_abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def do_has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def do_retarget(self, request_id: str, decode_id: str) -> bool:
        if request_id not in self.targets:
            return False
        self.targets[request_id] = decode_id
        return True

    def do_load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        """An idle worker's load (one whose cache holds nothing: no KV events)."""
        return WorkerLoad(self.worker_id, 0, 0, 0, 0.0)


class FakeLauncher:
    """Starts fake actors in dead workers' slots; they land in ``actors`` by id."""

    def __init__(self, actors: dict[str, FakeActor]) -> None:
        self.actors = actors
        self.launched: list[str] = []  # worker ids, in order
        self.failing_starts = 0  # this many of the next starts fail
        self.before_launch: Callable[[], None] = lambda: None  # runs as a start begins

    def launch(self, slot: WorkerSlot, worker_id: str, decode_handles: dict[str, Any]) -> FakeActor:
        self.before_launch()
        actor = FakeActor(worker_id, slot.role)
        actor.peers = dict(decode_handles) if slot.role == "prefill" else {}
        if self.failing_starts > 0:
            self.failing_starts -= 1
            actor.fails_to_start = True
        self.actors[worker_id] = actor
        self.launched.append(worker_id)
        return actor


def make_cluster(
    num_prefill: int, num_decode: int, *, launcher: bool = False, **config: Any
) -> tuple[Cluster, dict[str, FakeActor]]:
    """A router over fake actors (no threads started), after its first load poll. With
    ``launcher``, dead workers are replaced (``cluster.pool._launcher`` is the
    FakeLauncher)."""
    actors: dict[str, FakeActor] = {}
    handles = []
    for role, count in (("decode", num_decode), ("prefill", num_prefill)):
        for i in range(count):
            actor = FakeActor(f"{role}-{i}", role)
            if role == "prefill":
                actor.peers = {w: a for w, a in actors.items() if a.role == "decode"}
            actors[actor.worker_id] = actor
            handles.append(WorkerHandle(actor.worker_id, role, actor))
    handles.sort(key=lambda w: w.role != "prefill")
    cluster_config = ClusterConfig(
        model_dir="unused", num_prefill=num_prefill, num_decode=num_decode, **config
    )
    fake_launcher: Any = FakeLauncher(actors) if launcher else None
    cluster = Cluster(cluster_config, handles, fake_launcher)
    cluster.poll()
    return cluster, actors


def stall(cluster: Cluster, actors: dict[str, FakeActor], worker_id: str) -> None:
    """``worker_id`` stops answering, and has been silent for longer than ``dead_after_s``."""
    actors[worker_id].stalled = True
    cluster.pool.workers[worker_id].last_report -= 2 * cluster.config.dead_after_s


def submit(
    cluster: Cluster, request_id: str, prompt: tuple[int, ...] = (1, 2, 3, 4), **params: Any
) -> tuple[RequestTracker, list[ClientItem]]:
    """Place a request; what its client receives collects in the list."""
    items: list[ClientItem] = []
    request = GenerateRequest(
        request_id, list(prompt), SamplingParams(**params), cluster.gateway_id
    )
    return cluster.submit(request, items.append), items


def token(request_id: str, position: int, token_id: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent(request_id, 0, position, token_id, None, finish)


def token_ids(items: list[ClientItem]) -> list[int]:
    return [item.token_id for item in items if isinstance(item, TokenEvent)]
