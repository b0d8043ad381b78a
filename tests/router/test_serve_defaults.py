"""The layout ``pdserve serve`` picks when --prefill and --decode are not given, and the demo
model's dtype under --dtype auto."""

from __future__ import annotations

import pytest

from router.serve_defaults import (
    MIN_CORES_TO_DISAGGREGATE,
    demo_model_dtype,
    pick_layout,
    step_budget,
)


def _pick(cores: int, **overrides: object) -> tuple[int, int, float, bool, str]:
    kwargs: dict[str, object] = {
        "device": "cpu",
        "joins_cluster": False,
        "num_cores": cores,
        "worker_num_cpus": None,
        "bind_worker_cpus": False,
    }
    kwargs.update(overrides)
    prefill = kwargs.pop("num_prefill", None)
    decode = kwargs.pop("num_decode", None)
    layout = pick_layout(prefill, decode, **kwargs)  # type: ignore[arg-type]
    return (
        layout.num_prefill,
        layout.num_decode,
        layout.worker_num_cpus,
        layout.bind_worker_cpus,
        layout.reason,
    )


def test_a_two_core_cpu_machine_runs_one_colocated_worker_on_one_core_the_gateway_on_the_other() -> (
    None
):
    prefill, decode, cpus, bind, reason = _pick(2)
    assert (prefill, decode, cpus, bind) == (0, 1, 1, True)
    assert "2 cores" in reason and "--prefill 1 --decode 1" in reason


def test_one_core_runs_one_colocated_worker_unbound() -> None:
    prefill, decode, cpus, bind, reason = _pick(1)
    assert (prefill, decode, cpus, bind) == (0, 1, 1.0, False)
    assert "1 core" in reason


@pytest.mark.parametrize("cores", [MIN_CORES_TO_DISAGGREGATE, 8, 64])
def test_enough_cores_disaggregate(cores: int) -> None:
    assert _pick(cores) == (1, 1, 1.0, False, "")


@pytest.mark.parametrize(
    "overrides",
    [{"device": "cuda"}, {"joins_cluster": True}],
    ids=["gpus", "joined-cluster"],
)
def test_gpus_and_joined_clusters_disaggregate_on_any_local_core_count(
    overrides: dict[str, object],
) -> None:
    assert _pick(2, **overrides) == (1, 1, 1.0, False, "")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"num_prefill": 1}, (1, 1)),
        ({"num_decode": 2}, (1, 2)),
        ({"num_prefill": 0, "num_decode": 2}, (0, 2)),
        ({"num_prefill": 2, "num_decode": 1}, (2, 1)),
    ],
)
def test_the_flags_layout_runs_whatever_the_machine(
    flags: dict[str, int], expected: tuple[int, int]
) -> None:
    prefill, decode, cpus, bind, reason = _pick(2, **flags)
    assert (prefill, decode, cpus, bind, reason) == (*expected, 1.0, False, "")


def test_the_workers_cpus_flag_holds_in_the_colocated_layout() -> None:
    assert _pick(2, worker_num_cpus=0.0)[:4] == (0, 1, 0.0, True)
    assert _pick(4, worker_num_cpus=2.0)[:4] == (1, 1, 2.0, False)


def test_the_step_budget_is_512_tokens_on_cpu_2048_on_cuda_unless_given() -> None:
    assert step_budget(None, "cpu") == 512
    assert step_budget(None, "cuda") == 2048
    assert step_budget(4096, "cpu") == 4096
    assert step_budget(64, "cuda") == 64


@pytest.mark.parametrize(
    ("device", "flags", "dtype"),
    [
        ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ("cpu", {"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
        ("cpu", {"fp", "asimd", "bf16"}, "bfloat16"),  # Arm
        ("cpu", {"avx2", "avx512f", "avx512bw"}, "float32"),
        ("cpu", set(), "float32"),
        ("cuda", set(), "bfloat16"),
    ],
)
def test_the_demo_model_runs_in_bfloat16_where_the_cpu_has_native_bf16_dot_products(
    device: str, flags: set[str], dtype: str
) -> None:
    assert demo_model_dtype(device, flags) == dtype
