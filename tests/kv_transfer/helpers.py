"""Shared pieces of the kv_transfer tests: layouts, never-zero caches, channel pairs, sockets."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kv_transfer import KVCacheLayout, KVChannel, TransferStats, TransferTicket

HOST = "127.0.0.1"
CPU = torch.device("cpu")
SETUP_TIMEOUT_S = 30.0


# a quantized cache's scales for small_layout's 3 layers of 2 heads: [layer][K, V][head]
SMALL_KV_SCALES = tuple(((0.5, 0.25 * layer + 0.25), (1.0, 2.0)) for layer in range(3))


def small_layout(dtype: str = "float32") -> KVCacheLayout:
    # one block: 3 layers * 2 * (4 tokens * 2 heads * 8 dims) elements
    scales = SMALL_KV_SCALES if dtype in ("float8_e4m3fn", "int8") else None
    return KVCacheLayout(
        dtype, block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, kv_scales=scales
    )


def random_cache(layout: KVCacheLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A cache of random values, none of them zero (so an unwritten block shows)."""
    shape = layout.cache_shape(num_blocks)
    generator = torch.Generator().manual_seed(seed)
    values = 4 * torch.randn(shape, generator=generator)
    values[values.to(layout.torch_dtype).float() == 0] = 1
    return values.to(layout.torch_dtype)


def open_pair(
    transport: str,
    layout: KVCacheLayout,
    channel_id: str,
    receiver_layout: KVCacheLayout | None = None,
    **listen_options: int,
) -> tuple[KVChannel, KVChannel]:
    """(sender, receiver) of a channel built in this process, the receiver in a thread.
    ``receiver_layout`` (default ``layout``): the receiving end's, e.g. another rank's heads."""
    listener = KVChannel.listen(transport, layout, HOST, channel_id, CPU, **listen_options)
    with listener, ThreadPoolExecutor(1) as pool:
        receiver = pool.submit(
            KVChannel.connect, listener.rendezvous, receiver_layout or layout, CPU, SETUP_TIMEOUT_S
        )
        sender = listener.accept(SETUP_TIMEOUT_S)
        return sender, receiver.result()


def transfer(
    sender: KVChannel,
    receiver: KVChannel,
    src: tuple[torch.Tensor, Sequence[int]],
    dst: tuple[torch.Tensor, Sequence[int]],
    ticket: TransferTicket,
) -> tuple[TransferStats, TransferStats]:
    """Run one transfer, receiving in a thread; re-raise either side's error."""
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv_blocks, dst[0], dst[1], ticket)
        sent = sender.send_blocks(src[0], src[1], ticket)
        return sent, received.result()


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def listening_tcp_sockets() -> list[tuple[str, int]]:
    """(address hex as in /proc/net/tcp*, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    address, port = local.split(":")
                    found.append((address, int(port, 16)))
    return found


def is_wildcard_hex(address: str) -> bool:
    """0.0.0.0 and :: as they appear in /proc/net/tcp and tcp6."""
    return set(address) == {"0"}
