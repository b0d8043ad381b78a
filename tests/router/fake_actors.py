"""Worker actors and ``ray.get`` stand-ins for driving ``router.cluster.Cluster`` without Ray.

An actor method's ``.remote(...)`` records the call and returns a reference whose ``ray.get``
runs it: a dead actor raises ``RayActorError``, a stalled one ``GetTimeoutError``. The actors
keep only what routing needs: which requests they hold and where a prefill hands each off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from engine.messages import GenerateRequest, TokenEvent, WorkerLoad
from engine.sampling.params import SamplingParams
from router.cluster import Cluster, WorkerHandle
from router.cluster_config import ClusterConfig
from router.request_tracker import ClientItem, RequestTracker


class Ref:
    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call


class FakeRay:
    """What ``router.cluster`` uses of the ``ray`` module."""

    exceptions = ray.exceptions

    @staticmethod
    def get(ref: Ref | list[Ref], timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            return [r.call() for r in ref]
        try:
            return ref.call()
        except ray.exceptions.GetTimeoutError:
            time.sleep(timeout or 0.0)  # a stalled actor: the caller waits its whole timeout
            raise


class _Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Ref:
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

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or name.startswith("do_"):
            raise AttributeError(name)
        return _Method(self, name)

    def aborts(self) -> list[str]:
        return [args[0] for name, args in self.calls if name == "abort"]

    def do_submit(self, request: GenerateRequest, decode_id: str | None = None) -> bool:
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

    def do_load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, 0, 0, 0, 0.0)


def make_cluster(
    num_prefill: int, num_decode: int, **config: Any
) -> tuple[Cluster, dict[str, FakeActor]]:
    """A router over fake actors (no threads started), after its first load poll."""
    actors = {}
    handles = []
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(count):
            actor = FakeActor(f"{role}-{i}", role)
            actors[actor.worker_id] = actor
            handles.append(WorkerHandle(actor.worker_id, role, actor))
    cluster_config = ClusterConfig(
        model_dir="unused", num_prefill=num_prefill, num_decode=num_decode, **config
    )
    cluster = Cluster(cluster_config, handles)
    cluster._poll_loads()
    return cluster, actors


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
