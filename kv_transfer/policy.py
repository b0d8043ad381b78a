"""How workers use KV transfers: which transport moves which caches, deadlines, where sockets
bind, what happens on failure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What the decode side does when a request's KV does not arrive: run its prompt again
# ("recompute"), or end it with a clear error ("fail").
FailurePolicy = Literal["recompute", "fail"]
CPU_TRANSPORTS = ("gloo", "shm")  # move caches held in host memory
GPU_TRANSPORTS = ("nccl", "cuda_ipc")  # move caches held in GPU memory


def transports_for(device_type: str) -> tuple[str, ...]:
    """The transports that can move KV caches held on ``device_type`` ("fake" moves either)."""
    return (*(GPU_TRANSPORTS if device_type == "cuda" else CPU_TRANSPORTS), "fake")


def default_transport(device_type: str, gpus_per_worker: float) -> str:
    """gloo for CPU caches. For GPU caches nccl, or cuda_ipc when each worker takes a fraction
    of a GPU: then prefill and decode workers share GPUs on one host, and NCCL cannot pair two
    ranks on one GPU."""
    if device_type != "cuda":
        return "gloo"
    return "cuda_ipc" if gpus_per_worker < 1 else "nccl"


@dataclass(frozen=True, slots=True)
class TransferConfig:
    transport: str = "gloo"  # gloo | shm | nccl | cuda_ipc | fake
    host: str = "127.0.0.1"  # this node's cluster address: data-plane sockets bind here only
    timeout_s: float = 30.0  # deadline of one transfer, and of a channel's handshake
    reserve_timeout_s: float = 10.0  # how long a prefill worker waits for decode-side blocks
    failure_policy: FailurePolicy = "recompute"
    max_channels: int = 8  # open channels per worker; idle ones close, least recently used first
    max_concurrent_handoffs: int = 4  # a prefill worker's hand-offs in flight at once

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.reserve_timeout_s < 0:
            raise ValueError("transfer timeouts must be positive")
        if self.max_channels < 1 or self.max_concurrent_handoffs < 1:
            raise ValueError("max_channels and max_concurrent_handoffs must be >= 1")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure_policy must be 'recompute' or 'fail', got {self.failure_policy!r}"
            )
