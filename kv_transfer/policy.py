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


@dataclass(frozen=True, slots=True)
class Locality:
    """Where a worker's KV cache lives, as far as the choice of transport goes.

    ``shared_memory`` names the shared-memory filesystem the process sees (its machine's boot
    and its ``/dev/shm`` mount): two processes with equal names can map each other's segments.
    ``gpu`` is the UUID of the physical GPU that holds the cache ("" for a CPU cache)."""

    shared_memory: str
    gpu: str = ""


def network_transport(device_type: str) -> str:
    """The transport that reaches any peer: gloo for CPU caches, nccl for GPU ones."""
    return "nccl" if device_type == "cuda" else "gloo"


def transport_between(device_type: str, sender: Locality, receiver: Locality) -> str:
    """What ``--kv-transport auto`` picks for one prefill -> decode pair.

    CPU caches: shm when both see one shared-memory filesystem, else gloo. GPU caches: cuda_ipc
    when both caches sit on one GPU (NCCL cannot pair two ranks on one GPU, and Ray shows each
    worker only its own GPU, so cuda_ipc cannot reach another one), else nccl."""
    if device_type == "cuda":
        return "cuda_ipc" if sender.gpu and sender.gpu == receiver.gpu else "nccl"
    same_host = sender.shared_memory and sender.shared_memory == receiver.shared_memory
    return "shm" if same_host else "gloo"


def describe_auto(device_type: str) -> str:
    """``transport_between``'s rule in words, for start-up lines."""
    if device_type == "cuda":
        return "cuda_ipc within a GPU, nccl between GPUs"
    return "shm within a host, gloo between hosts"


@dataclass(frozen=True, slots=True)
class TransferConfig:
    transport: str = "gloo"  # gloo | shm | nccl | cuda_ipc | fake | auto (per pair: Locality)
    host: str = "127.0.0.1"  # this node's cluster address: data-plane sockets bind here only
    timeout_s: float = 30.0  # deadline of one transfer, and of a channel's handshake
    reserve_timeout_s: float = 10.0  # how long a prefill worker waits for decode-side blocks
    failure_policy: FailurePolicy = "recompute"
    max_channels: int = 8  # open channels per worker; idle ones close, least recently used first
    max_concurrent_handoffs: int = 4  # a prefill worker's hand-offs in flight to one decode worker
    checksum: bool = False  # every transfer's receiver checks a CRC32 of what landed (slower)

    @property
    def reservation_ttl_s(self) -> float:
        """How long a decode worker keeps blocks reserved for a transfer that has not begun:
        a prefill worker's hand-offs to it wait their turn (up to ``max_concurrent_handoffs``,
        each with deadlines of ``timeout_s``) before theirs; past that, its prefill worker has
        died or given up. (480 s at the defaults, as vLLM's abort timeout for remote KV.)"""
        return 4 * self.timeout_s * self.max_concurrent_handoffs

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.reserve_timeout_s < 0:
            raise ValueError("transfer timeouts must be positive")
        if self.max_channels < 1 or self.max_concurrent_handoffs < 1:
            raise ValueError("max_channels and max_concurrent_handoffs must be >= 1")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure_policy must be 'recompute' or 'fail', got {self.failure_policy!r}"
            )
