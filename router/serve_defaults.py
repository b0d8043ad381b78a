"""What ``pdserve serve`` runs when not told: its pools' layout, and each worker's step budget.

**Layout** (when ``--prefill`` and ``--decode`` are not given). Disaggregation pays where
prefill and decode run on compute of their own: a prompt's prefill then never stalls the
running decode batch, and each pool is sized for its phase. On GPUs, and on a Ray cluster that
this server joins, that is the case, and ``serve`` starts one prefill and one decode worker.

On a CPU machine that this server starts its own Ray on, the workers and the gateway (HTTP,
detokenizing, streaming every token) share the machine's cores. Two workers and the gateway
need three cores for each to have one of its own; with fewer, the prefill worker, the decode
worker and the gateway take turns on the same cores, and each hop of the first token waits for
its turn. There ``serve`` runs one colocated worker bound to every core but one, the gateway
and Ray on the last: vLLM's layout on CPU. Measured with NVIDIA AIPerf on a 2-core machine
(``docs/benchmarks.md``, "First token under load"): that layout's TTFT p50 was below 1P1D's at
every rate tried. ``--prefill N --decode M`` runs the layout asked for.

**Step budget** (``--max-num-batched-tokens``, when not given): 2048 tokens, as vLLM's server,
but 512 on CPU. A CPU matmul over 512 rows costs as much per row as one over 2048, so the
smaller budget loses no throughput, and it bounds a step: a running request's next token waits
for at most 512 prompt tokens' work instead of 2048 (inter-token latency under load), and a
prompt that arrives waits behind a quarter of the work.

**The demo model's dtype** (the bundled model, ``--dtype auto``): its checkpoint's bfloat16,
except on a CPU without native bfloat16 dot products (x86's AVX512-BF16 or AMX-BF16, Arm's
BF16), where it runs in float32. With them, the offline chat workload of
``bench.offline_vs_vllm`` took 5.9 s of CPU in bfloat16 against 7.7-7.9 s in float32 on the
2-core Xeon (session 71, the attention kernels reading bfloat16); without them oneDNN's
bfloat16 matmuls widen every operand, and float32 stays (as before those kernels, when it was
also the faster on that machine).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from engine.cpu_features import has_native_bfloat16

STEP_BUDGET = {"cpu": 512, "cuda": 2048}  # --max-num-batched-tokens by device
# Cores that a local CPU node needs to disaggregate: a prefill worker, a decode worker, and the
# gateway with Ray, one core each.
MIN_CORES_TO_DISAGGREGATE = 3


@dataclass(frozen=True, slots=True)
class PoolLayout:
    num_prefill: int  # 0: colocated workers (prefill and decode on each)
    num_decode: int
    worker_num_cpus: float  # Ray CPUs (and torch threads) per worker
    bind_worker_cpus: bool  # each worker on cores of its own (local Ray only)
    reason: str  # why one colocated worker, printed at start; "" for 1P1D or the flags' layout


def pick_layout(
    num_prefill: int | None,
    num_decode: int | None,
    *,
    device: str,
    joins_cluster: bool,
    num_cores: int,
    worker_num_cpus: float | None,
    bind_worker_cpus: bool,
    tensor_parallel: bool = False,
) -> PoolLayout:
    """The layout to run. ``None`` for a flag that was not given; ``num_cores``: the cores this
    process may run on; ``tensor_parallel``: a TP size above 1 was asked for."""
    cpus = 1.0 if worker_num_cpus is None else worker_num_cpus
    if num_prefill is not None or num_decode is not None:
        prefill = 1 if num_prefill is None else num_prefill
        decode = 1 if num_decode is None else num_decode
        return PoolLayout(prefill, decode, cpus, bind_worker_cpus, "")
    if device != "cpu" or joins_cluster or num_cores >= MIN_CORES_TO_DISAGGREGATE:
        return PoolLayout(1, 1, cpus, bind_worker_cpus, "")
    if tensor_parallel:  # its ranks are processes of their own: nothing to bind per worker
        return PoolLayout(
            0,
            1,
            cpus,
            False,
            f"{num_cores} cores: too few to give a prefill worker's ranks, a decode worker's "
            "ranks and the gateway one each; disaggregate with --prefill 1 --decode 1",
        )
    if num_cores < 2:  # nothing to bind to: the worker and the gateway share the one core
        return PoolLayout(
            0, 1, cpus, False, "1 core: too few to give a prefill and a decode worker one each"
        )
    threads = max(1, num_cores - 1) if worker_num_cpus is None else worker_num_cpus
    return PoolLayout(
        0,
        1,
        threads,
        True,
        f"{num_cores} cores: too few to give a prefill worker, a decode worker and the gateway "
        f"one each; it runs on {threads:g} of them, the gateway on the rest; disaggregate with "
        "--prefill 1 --decode 1",
    )


def step_budget(max_num_batched_tokens: int | None, device: str) -> int:
    """``--max-num-batched-tokens``, or the device's default when it was not given."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return STEP_BUDGET.get(device, STEP_BUDGET["cuda"])


def demo_model_dtype(device: str, cpu_flags: Collection[str]) -> str:
    """The bundled demo model's dtype under ``--dtype auto``: its checkpoint's bfloat16, float32
    on a CPU whose ``cpu_flags`` name no native bfloat16 dot products."""
    if device == "cpu" and not has_native_bfloat16(cpu_flags):
        return "float32"
    return "bfloat16"
