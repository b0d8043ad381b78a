"""The launcher hands each pool's actors their settings: speculative decoding goes to the decode
pool only (a prefill worker samples each prompt's first token, never a draft), but for a
prediction layer's (method mtp), whose KV the prefill workers compute into what they hand off, the same for a
worker started in a dead one's slot and for a worker changing role; every worker schedules by
the cluster's scheduling policy, asynchronously if it says so. A worker changes role in its own
process only where both pools' workers are one rank reserving the same resources. Actor classes
are recorders here; no Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.speculative.config import SpeculativeConfig
from router.cluster_config import ClusterConfig
from router.worker_host import WorkerSpec
from router.worker_slots import WorkerLauncher, plan_slots
from tests.fixtures.tiny_models import make_tiny_mtp_model


class _RecordingActor:
    def __init__(self, resources: Any, started: list[WorkerSpec]) -> None:
        self.resources, self.started = resources, started

    def options(self, **options: Any) -> _RecordingActor:
        assert not options  # a worker of one rank: its class's own reservation, no group
        return self

    def remote(self, spec: WorkerSpec, cpus: tuple[int, ...], placement: Any) -> str:
        self.started.append(spec)
        return f"{spec.role}-actor"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[WorkerSpec]:
    calls: list[WorkerSpec] = []
    monkeypatch.setattr(
        "router.worker_slots.remote_worker_actor",
        lambda resources=None, **_: _RecordingActor(resources, calls),
    )
    return calls


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_the_speculative_config_reaches_decode_actors_only(
    started: list[WorkerSpec], num_prefill: int
) -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    config = ClusterConfig("model", num_prefill=num_prefill, num_decode=2, speculative=spec)
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    assert [s.role for s in started] == ["decode", "decode"] + ["prefill"] * num_prefill
    for worker in started:
        assert worker.speculative is (spec if worker.role == "decode" else None)
    # a worker changing role gets its new role's: a prefill one none, a decode one the config
    assert launcher.spec("prefill", "prefill-7", {}).speculative is None
    assert launcher.spec("decode", "decode-7", {}).speculative is spec


def test_a_prediction_layers_config_reaches_the_prefill_actors_too(
    started: list[WorkerSpec], tmp_path: Path
) -> None:
    model = make_tiny_mtp_model(tmp_path, "DeepseekV3ForCausalLM")
    spec = SpeculativeConfig(num_speculative_tokens=2, method="mtp")
    config = ClusterConfig(str(model), num_prefill=1, num_decode=1, speculative=spec)
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    assert sorted(s.role for s in started) == ["decode", "prefill"]
    assert all(worker.speculative is spec for worker in started)
    assert launcher.spec("prefill", "prefill-7", {}).speculative is spec


def test_without_a_speculative_config_decode_actors_get_none(started: list[WorkerSpec]) -> None:
    config = ClusterConfig("model", num_prefill=0, num_decode=1)
    (slot,) = plan_slots(config, None)
    WorkerLauncher(config).launch(slot, slot.worker_id(1), {})  # a replacement, the same way
    (spec,) = started
    assert spec.worker_id == "decode-0-r1" and spec.speculative is None


def test_a_prefill_actor_gets_the_decode_workers_and_their_ranks(
    started: list[WorkerSpec],
) -> None:
    config = ClusterConfig("model", num_prefill=1, num_decode=1)
    launcher = WorkerLauncher(config)
    prefill_slot = next(s for s in plan_slots(config, None) if s.role == "prefill")
    launcher.launch(prefill_slot, "prefill-0", {"decode-0": "handle"})
    (spec,) = started
    assert spec.decode_handles == {"decode-0": "handle"} and spec.decode_tp == 1
    assert spec.scheduler == config.prefill_scheduler_config()


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_every_actor_schedules_by_the_clusters_policy(
    started: list[WorkerSpec], num_prefill: int
) -> None:
    config = ClusterConfig(
        "model", num_prefill=num_prefill, num_decode=2, scheduling_policy="priority"
    )
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    assert len(started) == 2 + num_prefill
    assert {s.scheduler.policy for s in started} == {"priority"}


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_every_actor_schedules_asynchronously_if_the_cluster_does(
    started: list[WorkerSpec], num_prefill: int
) -> None:
    config = ClusterConfig("model", num_prefill=num_prefill, num_decode=2, async_scheduling=True)
    launcher = WorkerLauncher(config)
    for slot in plan_slots(config, None):
        launcher.launch(slot, slot.worker_id(0), {})
    assert len(started) == 2 + num_prefill
    assert {s.scheduler.async_scheduling for s in started} == {True}


def test_workers_change_role_in_place_when_both_pools_are_alike(
    started: list[WorkerSpec], llama_dir: Path
) -> None:
    assert WorkerLauncher(ClusterConfig("model", num_prefill=1, num_decode=1)).changes_in_place()
    # a role's own resources (its nodes): a worker of the other role may not fit where it is
    config = ClusterConfig("model", num_prefill=1, num_decode=1, prefill_resources={"p": 1.0})
    assert not WorkerLauncher(config).changes_in_place()
    # several ranks: their ranks change with them, so both pools' workers need as many
    config = ClusterConfig(str(llama_dir), num_prefill=1, num_decode=1, prefill_tp=2, decode_tp=2)
    assert WorkerLauncher(config).changes_in_place()
    config = ClusterConfig(str(llama_dir), num_prefill=1, num_decode=1, decode_tp=2)
    assert not WorkerLauncher(config).changes_in_place()
