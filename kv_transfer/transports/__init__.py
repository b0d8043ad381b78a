"""Transport registry: which listener / connect function serves each transport name.

Imports of a transport's module happen here only, so `KVChannel` stays transport-agnostic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kv_transfer.deadline import Deadline
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import SUPPORTED_TRANSPORTS, ChannelRendezvous
from kv_transfer.policy import CPU_TRANSPORTS, GPU_TRANSPORTS
from kv_transfer.transports.base import Endpoint, ListenerBackend
from kv_transfer.transports.cuda_ipc import CudaIpcListener, connect_cuda_ipc
from kv_transfer.transports.fake import FakeListener, connect_fake
from kv_transfer.transports.pg_bootstrap import GroupListener, connect_group
from kv_transfer.transports.shm import ShmListener, connect_shm

# Staging unit per transport: a transfer moves in chunks of at most this, through two slots.
# shm: small enough that a slot is still in the CPU cache when the receiver copies it out;
# gloo: large, since each message costs a rendezvous on loopback TCP (bench/kv_transfer.py).
# Staging memory per channel end is two chunks. cuda_ipc stages
# nothing (the receiver copies out of the sender's cache): its chunk is what a checksum reads
# at a time.
DEFAULT_CHUNK_BYTES: dict[str, int] = {
    "gloo": 64 << 20,
    "nccl": 32 << 20,
    "shm": 4 << 20,
    "cuda_ipc": 32 << 20,
    "fake": 1 << 30,  # unused: the fake moves a transfer in one piece
}


def check_device(transport: str, device: torch.device) -> None:
    if transport not in SUPPORTED_TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; expected one of {SUPPORTED_TRANSPORTS}")
    if transport in CPU_TRANSPORTS and device.type != "cpu":
        raise ValueError(f"the {transport} transport moves CPU caches, not {device}")
    if transport in GPU_TRANSPORTS and device.type != "cuda":
        raise ValueError(f"the {transport} transport moves CUDA caches, not {device}")
    if transport in GPU_TRANSPORTS and not torch.cuda.is_available():
        raise RuntimeError(f"the {transport} transport needs CUDA; this torch has no GPU")
    if transport == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("the nccl transport needs a torch build with NCCL")


def make_listener(
    transport: str,
    layout: KVCacheLayout,
    host: str,
    channel_id: str,
    device: torch.device,
    chunk_bytes: int | None,
) -> ListenerBackend:
    check_device(transport, device)
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES[transport]
    if chunk_bytes < layout.moved_plane_nbytes:
        raise ValueError(
            f"chunk_bytes {chunk_bytes} is under one block of one layer "
            f"({layout.moved_plane_nbytes} B of the moved heads)"
        )
    if transport in ("gloo", "nccl"):
        return GroupListener(transport, layout, host, channel_id, device, chunk_bytes)
    if transport == "shm":
        return ShmListener(layout, host, channel_id, chunk_bytes)
    if transport == "cuda_ipc":
        return CudaIpcListener(layout, host, channel_id, device, chunk_bytes)
    return FakeListener(layout, host, channel_id)


def connect_endpoint(
    rendezvous: ChannelRendezvous, layout: KVCacheLayout, device: torch.device, deadline: Deadline
) -> Endpoint:
    transport = rendezvous.transport
    check_device(transport, device)
    if transport in ("gloo", "nccl"):
        return connect_group(transport, rendezvous, layout, device, deadline)
    if transport == "shm":
        return connect_shm(rendezvous, layout, deadline)
    if transport == "cuda_ipc":
        return connect_cuda_ipc(rendezvous, layout, device, deadline)
    return connect_fake(rendezvous, layout)
