"""The launcher hands each pool's actors their settings: speculative decoding goes to the decode
pool only (a prefill worker samples each prompt's first token, never a draft), the same for a
worker started in a dead one's slot; every worker schedules by the cluster's scheduling policy,
asynchronously if it says so. Actor classes are recorders here; no Ray."""

from __future__ import annotations

from typing import Any

import pytest

from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from router.cluster_config import ClusterConfig
from router.worker_slots import WorkerLauncher, plan_slots


class _RecordingActor:
    def __init__(self, role: str, started: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.role, self.started = role, started

    def options(self, **options: Any) -> _RecordingActor:
        assert not options  # a worker of one rank: its class's own reservation, no group
        return self

    def remote(self, *args: Any, **kwargs: Any) -> str:
        self.started.append((self.role, (*args, *kwargs.values())))
        return f"{self.role}-actor"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    calls: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(
        "router.worker_slots.remote_decode_actor", lambda **_: _RecordingActor("decode", calls)
    )
    monkeypatch.setattr(
        "router.worker_slots.remote_prefill_actor", lambda **_: _RecordingActor("prefill", calls)
    )
    return calls


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_the_speculative_config_reaches_decode_actors_only(
    started: list[tuple[str, tuple[Any, ...]]], num_prefill: int
) -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    config = ClusterConfig("model", num_prefill=num_prefill, num_decode=2, speculative=spec)
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    assert [role for role, _ in started] == ["decode", "decode"] + ["prefill"] * num_prefill
    for role, args in started:
        if role == "decode":  # DecodeActor(worker_id, load, cache, scheduler, transfer, cpus,
            assert args[6] is spec  # spec, parallel, placement)
        else:
            assert spec not in args


def test_without_a_speculative_config_decode_actors_get_none(
    started: list[tuple[str, tuple[Any, ...]]],
) -> None:
    config = ClusterConfig("model", num_prefill=0, num_decode=1)
    (slot,) = plan_slots(config, None)
    WorkerLauncher(config).launch(slot, slot.worker_id(1), {})  # a replacement, the same way
    ((_, args),) = started
    assert args[0] == "decode-0-r1" and args[6] is None


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_every_actor_schedules_by_the_clusters_policy(
    started: list[tuple[str, tuple[Any, ...]]], num_prefill: int
) -> None:
    config = ClusterConfig(
        "model", num_prefill=num_prefill, num_decode=2, scheduling_policy="priority"
    )
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    schedulers = [a for _, args in started for a in args if isinstance(a, SchedulerConfig)]
    assert len(schedulers) == len(started) == 2 + num_prefill
    assert {s.policy for s in schedulers} == {"priority"}


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_every_actor_schedules_asynchronously_if_the_cluster_does(
    started: list[tuple[str, tuple[Any, ...]]], num_prefill: int
) -> None:
    config = ClusterConfig("model", num_prefill=num_prefill, num_decode=2, async_scheduling=True)
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    schedulers = [a for _, args in started for a in args if isinstance(a, SchedulerConfig)]
    assert len(schedulers) == len(started) == 2 + num_prefill
    assert {s.async_scheduling for s in schedulers} == {True}
