"""What a device does per second, and a step's time on it for a model (``pdserve plan``).

A ``Hardware`` profile is given (``--hardware h100`` and the other presets, or a JSON file) or
measured on the machine at hand (``pdserve profile``). Its step time for a model on a worker of
tensor-parallel size ``tp`` is a roofline:

    step = overhead + matmuls + attention + all-reduces
    matmuls   = max(FLOPs of the step's tokens / (tp * FLOP/s),
                    weight bytes / (tp * weights' read rate))
                (a checkpoint's 8-bit matmuls at the device's int8 or float8 rate, where it
                has one: ``int8_ops_per_s``, ``fp8_flops_per_s``; the weights' rate: a
                profile's own, else the memory's; of a mixture of experts, the experts the
                step's tokens go to; of an input embedding apart from the LM head, its
                tokens' rows)
    attention = max(FLOPs of the attention pairs / (tp * FLOP/s),
                    KV bytes the step reads or writes / (tp * memory bytes/s))
                (a sliding layer's pairs within its window; a decoding sequence's KV read
                once, its drafts with its token)
    all-reduces (tp > 1): two per layer of the step's activations, over the link

The matmuls and the attention are kernels that run one after another, each bound by its own
compute or memory (a large batch's matmuls compute-bound while its attention reads KV), so
their times add.

On a CPU machine (``host_cores``) the workers' steps share the host's cores with each other and
with the host's other work, on ``host_front_door_threads`` threads: per streamed token
(``host_seconds_per_token``: the gateway's streaming, a load generator's) and per KV hand-off
(``host_seconds_per_handoff``), and each worker's own process per token it samples, after its
step (``host_worker_seconds_per_token``); both also per step's batch of outputs
(``host_seconds_per_batch``, ``host_worker_seconds_per_batch``). The simulation slows the
steps by the share of a core they get and delivers a token once its streaming is done
(shared_host.py). A profile is
measured on a quiet machine; on the busy host a step costs more CPU time than that (its caches
and memory shared, its thread switched out and back): ``host_prompt_step_cpu_factor`` times its
profiled time for a step that computes prompt tokens, ``host_decode_step_cpu_factor`` for a
decode-only one (measured on a served cluster: bench.plan_accuracy).

A profile measured on the machine carries the step-time fit of the model it was measured with
(``measured``: the router's ``StepCost``, fitted to about a thousand real engine steps), which is
used as it is for that model at tensor-parallel size 1: on a CPU, where a roofline is a loose
guide, that is what the workers will do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from router.latency_model import StepCost, StepShape
from router.planner.model_costs import EightBitMatmul, ModelCosts

# the gateway's and router's own time to a request's first token, when not measured (5.5 ms on the
# CPU machine: tests/cluster/test_latency_forecast_cluster.py's path correction)
DEFAULT_PATH_OVERHEAD_S = 5e-3


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    flops_per_s: float  # sustained dense matmul FLOP/s of one device (bf16)
    memory_bytes_per_s: float  # its memory bandwidth
    device_memory_bytes: float  # weights + KV cache must fit in this (times --memory-fraction)
    link_bytes_per_s: float  # a KV hand-off's bandwidth between two workers
    link_latency_s: float = 50e-6  # a hand-off's fixed cost
    step_overhead_s: float = 1e-3  # per step, besides compute and memory (scheduling, launch)
    path_overhead_s: float = (
        DEFAULT_PATH_OVERHEAD_S  # per request: the front doors' and router's hops
    )
    measured_model: str | None = None  # the model ``measured`` was fitted on
    measured: StepCost | None = None
    # a CPU machine: its cores are shared by the workers' threads and the host's other work
    host_cores: int = 0  # 0: each worker computes on devices of its own
    host_seconds_per_token: float = 0.0  # CPU seconds of that other work per streamed token
    host_seconds_per_handoff: float = 0.0  # and per KV hand-off
    host_front_door_threads: int = 1  # the threads that work runs on (the gateway's)
    # CPU seconds a worker's own process spends per token it samples besides its steps (its
    # output batches made and streamed out), after each step: its threads share one lock
    host_worker_seconds_per_token: float = 0.0
    # and per batch of a step's outputs, whatever its tokens: in the worker's process, and in
    # the host's other work (the front door receives it); a busy host's cost per token falls
    # as its batches grow
    host_worker_seconds_per_batch: float = 0.0
    host_seconds_per_batch: float = 0.0
    worker_threads: int = 1  # a worker rank's threads (as measured)
    # a step's CPU time on the busy host over its profiled time: one computing prompt tokens,
    # and a decode-only one
    host_prompt_step_cpu_factor: float = 1.0
    host_decode_step_cpu_factor: float = 1.0
    # sustained dense matmul rates on 8-bit operands (a W8A8 or FP8 checkpoint's linear
    # layers: datasheet peaks derated, or the engine's 8-bit forward as ``pdserve profile``
    # measured it on a GPU); 0: at ``flops_per_s`` (no such tensor cores, or not measured)
    int8_ops_per_s: float = 0.0
    fp8_flops_per_s: float = 0.0
    # a device's copies to and from host memory (the KV host tier's, --kv-offload-gb); 0: at
    # ``memory_bytes_per_s`` (a CPU machine's host tier is the same memory)
    host_link_bytes_per_s: float = 0.0
    # a step's read of its weights: a matmul of one row streaming a large weight, as ``pdserve
    # profile`` measures it (its matmul kernels read weights at their own rate, the attention
    # kernels the KV at ``memory_bytes_per_s``); 0: at ``memory_bytes_per_s`` (the presets)
    weight_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        seconds = min(
            self.host_seconds_per_token,
            self.host_seconds_per_handoff,
            self.host_worker_seconds_per_token,
            self.host_worker_seconds_per_batch,
            self.host_seconds_per_batch,
        )
        factors = min(self.host_prompt_step_cpu_factor, self.host_decode_step_cpu_factor)
        if (
            self.host_cores < 0
            or seconds < 0
            or min(self.worker_threads, self.host_front_door_threads) < 1
            or not factors > 0
        ):
            raise ValueError(
                f"hardware profile {self.name!r}: host_cores, host_seconds_per_token, "
                f"host_seconds_per_handoff, host_worker_seconds_per_token, "
                f"host_worker_seconds_per_batch and host_seconds_per_batch must be >= 0, "
                f"worker_threads and host_front_door_threads >= 1, "
                f"host_prompt_step_cpu_factor and host_decode_step_cpu_factor > 0"
            )
        for name in (
            "flops_per_s",
            "memory_bytes_per_s",
            "device_memory_bytes",
            "link_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {name} must be > 0")
        if min(self.int8_ops_per_s, self.fp8_flops_per_s) < 0:
            raise ValueError(
                f"hardware profile {self.name!r}: int8_ops_per_s and fp8_flops_per_s must be "
                f">= 0 (0: no faster than flops_per_s)"
            )
        for name in ("host_link_bytes_per_s", "weight_bytes_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"hardware profile {self.name!r}: {name} must be >= 0 (0: at "
                    f"memory_bytes_per_s)"
                )

    @property
    def weight_read_bytes_per_s(self) -> float:
        """A step's read of its weights: its own measured rate, else the memory's."""
        return self.weight_bytes_per_s or self.memory_bytes_per_s

    @property
    def host_copy_bytes_per_s(self) -> float:
        """A device's copies to and from host memory: its host link's, else its memory's."""
        return self.host_link_bytes_per_s or self.memory_bytes_per_s

    def eight_bit_rate(self, kind: EightBitMatmul) -> float:
        """Matmul FLOP/s on 8-bit operands of ``kind`` ("int8", "fp8"): the profile's (a
        measured one may be below ``flops_per_s``: the engine's 8-bit kernel slower than the
        device's bf16 matmul), or ``flops_per_s`` where it has none (0)."""
        rate = self.int8_ops_per_s if kind == "int8" else self.fp8_flops_per_s
        return rate or self.flops_per_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Hardware:
        measured = data.get("measured")
        fields = {**data, "measured": None if measured is None else StepCost(**measured)}
        try:
            return cls(**fields)
        except TypeError as error:  # a missing or unknown key
            raise ValueError(f"hardware profile: {error}") from error

    @classmethod
    def load(cls, path: str | Path) -> Hardware:
        return cls.from_json(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


# Presets: datasheet peaks derated to what serving sustains (dense matmuls at ~60 % of peak,
# HBM and links at ~80 %); links are NVLink between GPUs of a node. Dense (not sparse)
# tensor-core peaks: bf16, int8, float8 (the A100 has no float8 tensor cores: the engine's FP8
# checkpoints run there at its bf16 rate). Host links: PCIe, one direction (Gen5 x16 64 GB/s,
# Gen4 x16 32 GB/s).
PRESETS = {
    "h100": Hardware(
        "h100", 0.6 * 989e12, 0.8 * 3.35e12, 80e9, 0.8 * 450e9,
        int8_ops_per_s=0.6 * 1979e12, fp8_flops_per_s=0.6 * 1979e12,
        host_link_bytes_per_s=0.8 * 64e9,
    ),
    "h200": Hardware(
        "h200", 0.6 * 989e12, 0.8 * 4.8e12, 141e9, 0.8 * 450e9,
        int8_ops_per_s=0.6 * 1979e12, fp8_flops_per_s=0.6 * 1979e12,
        host_link_bytes_per_s=0.8 * 64e9,
    ),
    "a100": Hardware(
        "a100", 0.6 * 312e12, 0.8 * 2.0e12, 80e9, 0.8 * 300e9, int8_ops_per_s=0.6 * 624e12,
        host_link_bytes_per_s=0.8 * 32e9,
    ),
    "l40s": Hardware(
        "l40s", 0.6 * 362e12, 0.8 * 0.864e12, 48e9, 0.8 * 32e9,
        int8_ops_per_s=0.6 * 733e12, fp8_flops_per_s=0.6 * 733e12,
        host_link_bytes_per_s=0.8 * 32e9,
    ),
}  # fmt: skip


def hardware_named(name_or_path: str) -> Hardware:
    """A preset by name, or a profile's JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"--hardware must be one of {', '.join(PRESETS)} or a profile JSON file "
            f"(pdserve profile); {name_or_path!r} is neither"
        )
    return Hardware.load(path)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """A step's seconds for one model on one worker of a given tensor-parallel size."""

    model: ModelCosts
    hardware: Hardware
    tp: int = 1

    def __call__(self, shape: StepShape) -> float:
        seconds = self._quiet(shape)
        if not self.hardware.host_cores:
            return seconds
        if shape.num_prefill_tokens:
            return seconds * self.hardware.host_prompt_step_cpu_factor
        return seconds * self.hardware.host_decode_step_cpu_factor

    def _quiet(self, shape: StepShape) -> float:
        """The step's time as profiled, alone on a quiet machine."""
        hardware, model = self.hardware, self.model
        if hardware.measured is not None and hardware.measured_model == model.name and self.tp == 1:
            return hardware.measured.seconds(shape)
        tokens = shape.num_prefill_tokens + shape.num_decode_tokens
        pairs = shape.attention_pairs
        if pairs is None:
            pairs = shape.prefill_attention_tokens + shape.decode_context_tokens
        kv_read = shape.decode_kv_tokens
        if kv_read is None:
            kv_read = shape.decode_context_tokens
        eight_bit = model.eight_bit_flops_per_token * tokens
        matmul_compute = (model.flops_per_token * tokens - eight_bit) / hardware.flops_per_s
        if model.eight_bit_matmul is not None:
            matmul_compute += eight_bit / hardware.eight_bit_rate(model.eight_bit_matmul)
        weights = model.weight_bytes_read(tokens) / hardware.weight_read_bytes_per_s
        attention_compute = model.attention_flops_per_pair * pairs / hardware.flops_per_s
        kv_bytes = model.kv_bytes_per_token * (kv_read + shape.num_prefill_tokens)
        kv = kv_bytes / hardware.memory_bytes_per_s
        matmuls = max(matmul_compute, weights) / self.tp
        attention = max(attention_compute, kv) / self.tp
        reduce = 0.0
        if self.tp > 1:
            payload = 2 * model.num_layers * tokens * model.activation_bytes_per_token
            reduce = 2 * (self.tp - 1) / self.tp * payload / hardware.link_bytes_per_s
        return hardware.step_overhead_s + matmuls + attention + reduce


def transfer_seconds(
    hardware: Hardware, model: ModelCosts, block_size: int, num_blocks: int
) -> float:
    """A hand-off of ``num_blocks`` blocks' KV over the link."""
    return (
        hardware.link_latency_s
        + num_blocks * model.kv_bytes_per_block(block_size) / hardware.link_bytes_per_s
    )
