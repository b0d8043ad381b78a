"""ClusterConfig's KV transport and GPU memory share.

"auto" reaches the workers as "auto" (each prefill worker picks per pair; the rule is tested in
tests/kv_transfer/test_pair_transport.py), and a transport that cannot move the device's caches
is refused at start-up, naming the flag (before, the server started and every hand-off
failed). Workers that share a GPU each budget their share of it. Both pools' schedulers
follow the scheduling policy and async scheduling, which is refused with speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import transports_for
from router.cluster_config import ClusterConfig


@pytest.mark.parametrize(
    ("device", "words"),
    [
        ("cpu", "shm within a host, gloo between hosts"),
        ("cuda", "cuda_ipc within a GPU, nccl between GPUs"),
    ],
)
def test_auto_is_picked_per_pair_by_the_workers(device: str, words: str) -> None:
    config = ClusterConfig("model", device=device, worker_num_gpus=0.5 if device == "cuda" else 0)
    assert config.kv_transport == "auto"
    assert config.transfer_config().transport == "auto"
    assert config.transport_in_words == words


def test_an_explicit_transport_is_kept() -> None:
    config = ClusterConfig("model", device="cuda", worker_num_gpus=0.5, kv_transport="nccl")
    assert config.transfer_config().transport == "nccl"
    assert config.transport_in_words == "nccl"
    assert ClusterConfig("model", kv_transport="shm").transfer_config().transport == "shm"


@pytest.mark.parametrize(
    ("device", "transport", "usable"),
    [
        ("cuda", "gloo", "nccl, cuda_ipc"),
        ("cuda", "shm", "nccl, cuda_ipc"),
        ("cpu", "nccl", "gloo, shm"),
    ],
)
def test_a_transport_for_the_other_device_is_refused_naming_the_flag(
    device: str, transport: str, usable: str
) -> None:
    with pytest.raises(ValueError) as error:
        ClusterConfig("model", device=device, kv_transport=transport)
    message = str(error.value)
    assert f"--kv-transport {transport} cannot move {device} KV caches" in message
    assert f"use auto, {usable}" in message


def test_every_transport_moves_one_kind_of_cache() -> None:
    assert set(transports_for("cpu")) & set(transports_for("cuda")) == {"fake"}


@pytest.mark.parametrize(("gpus_per_worker", "fraction"), [(1.0, 0.8), (2.0, 0.8), (0.5, 0.4)])
def test_each_worker_budgets_its_share_of_the_gpu(gpus_per_worker: float, fraction: float) -> None:
    config = ClusterConfig(
        "model", device="cuda", worker_num_gpus=gpus_per_worker, gpu_memory_utilization=0.8
    )
    assert config.cache_config().budget.memory_fraction == pytest.approx(fraction)


def test_gpu_memory_utilization_out_of_range_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\], got 1.2"):
        ClusterConfig("model", device="cuda", gpu_memory_utilization=1.2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "--block-size must be >= 1, got 0"),
        ("max_num_seqs", 0, "--max-num-seqs must be >= 1, got 0"),
        ("max_num_batched_tokens", 0, "--max-num-batched-tokens must be >= 1, got 0"),
        ("num_kv_blocks", 0, "--num-kv-blocks must be >= 1, got 0"),
        ("max_model_len", 1, "--max-model-len must be >= 2, got 1"),
    ],
)
def test_engine_settings_are_refused_here_naming_the_flag(
    field: str, value: int, message: str
) -> None:
    """Each worker refused these, once Ray had started (9-14 s in), naming the field."""
    with pytest.raises(ValueError) as error:
        ClusterConfig("model", **{field: value})  # type: ignore[arg-type]
    assert str(error.value) == message


def test_negative_worker_restarts_are_refused_naming_the_flag() -> None:
    with pytest.raises(
        ValueError, match=r"--max-worker-restarts must be >= 0 \(0: never\), got -1"
    ):
        ClusterConfig("model", max_worker_restarts=-1)
    with pytest.raises(ValueError, match="restart_delay_s must be >= 0, got -0.5"):
        ClusterConfig("model", restart_delay_s=-0.5)


def test_the_scheduling_policy_reaches_both_pools_schedulers() -> None:
    for policy in ("fcfs", "priority"):
        config = ClusterConfig("model", scheduling_policy=policy, prefill_max_num_batched_tokens=8)
        assert config.scheduler_config().policy == policy
        assert config.prefill_scheduler_config().policy == policy
        assert config.prefill_scheduler_config().max_num_batched_tokens == 8
    assert ClusterConfig("model").scheduler_config().policy == "fcfs"  # vLLM's default


def test_an_unknown_scheduling_policy_is_refused_naming_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError) as error:
        ClusterConfig("model", scheduling_policy="lifo")  # type: ignore[arg-type]
    assert str(error.value) == "--scheduling-policy must be one of fcfs, priority; got 'lifo'"


def test_async_scheduling_reaches_both_pools_schedulers() -> None:
    for async_scheduling in (True, False):
        config = ClusterConfig("model", async_scheduling=async_scheduling, num_prefill=1)
        assert config.scheduler_config().async_scheduling is async_scheduling
        assert config.prefill_scheduler_config().async_scheduling is async_scheduling
    assert ClusterConfig("model").scheduler_config().async_scheduling is False  # vLLM's default


def test_async_scheduling_with_speculative_decoding_is_refused_naming_both_flags() -> None:
    """At start-up, before the workers (each of whose engines would refuse it)."""
    spec = SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError) as error:
        ClusterConfig("model", async_scheduling=True, speculative=spec)
    assert str(error.value).startswith(
        "--async-scheduling does not combine with --speculative-config"
    )
    assert ClusterConfig("model", speculative=spec).speculative is spec  # either alone is fine


def test_a_prediction_layer_that_cannot_draft_is_refused_at_start(llama_dir: Path) -> None:
    """Before any worker starts, naming the field: a model without one."""
    spec = SpeculativeConfig(num_speculative_tokens=2, method="mtp")
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        ClusterConfig(str(llama_dir), speculative=spec)
