"""A receiver in another process (multiprocessing 'spawn'), for cross-process and crash tests.

Arguments are plain data; results come back through a multiprocessing queue (test-only: the
library itself never pickles on its sockets).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import torch

from kv_transfer import ChannelRendezvous, KVCacheLayout, KVChannel, TransferTicket
from kv_transfer.transports.process_group import GroupEndpoint
from tests.kv_transfer.helpers import CPU, SETUP_TIMEOUT_S, random_cache


def receiver_main(
    rendezvous: dict[str, Any],
    layout: dict[str, Any],
    mode: str,
    jobs: list[tuple[dict[str, Any], list[int]]],
    num_blocks: int,
    results: Any,
    header_gate: Any = None,
) -> None:
    """Connect; then receive `jobs` (mode "receive") or idle until killed (mode "idle").
    `header_gate`: see `hold_header_checks`."""
    if header_gate is not None:
        hold_header_checks(header_gate)
    rendezvous["extra"] = tuple(tuple(pair) for pair in rendezvous["extra"])
    kv_layout = KVCacheLayout(**layout)
    try:
        channel = KVChannel.connect(
            ChannelRendezvous(**rendezvous), kv_layout, CPU, SETUP_TIMEOUT_S
        )
    except Exception as exc:  # report, do not hang the parent
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    results.put(("connected", None))
    if mode == "idle":
        time.sleep(3600)
    cache = random_cache(kv_layout, num_blocks, seed=99)
    try:
        for ticket, block_ids in jobs:
            channel.recv_blocks(cache, block_ids, TransferTicket(**ticket))
    except Exception as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    results.put(("cache", cache.view(torch.uint8).numpy().copy()))
    channel.close()


def hold_header_checks(gate: Any) -> None:
    """In this process, a gloo / nccl endpoint checks a transfer's header only once `gate` (a
    multiprocessing Event) is set: what the sender posts meanwhile meets the receives already
    posted here, as it would on a slow receiver."""
    check_header = GroupEndpoint._check_header

    def held(self: GroupEndpoint, header: list[int], ticket: TransferTicket) -> None:
        gate.wait(SETUP_TIMEOUT_S)
        check_header(self, header, ticket)

    GroupEndpoint._check_header = held  # type: ignore[method-assign]


def plain_rendezvous(rendezvous: ChannelRendezvous) -> dict[str, Any]:
    """The rendezvous as plain data, for a spawned process's arguments."""
    return {
        "transport": rendezvous.transport,
        "channel_id": rendezvous.channel_id,
        "host": rendezvous.host,
        "port": rendezvous.port,
        "extra": [list(pair) for pair in rendezvous.extra],
    }


def start_receiver(
    rendezvous: ChannelRendezvous,
    layout: KVCacheLayout,
    mode: str,
    jobs: list[tuple[TransferTicket, list[int]]],
    num_blocks: int,
    header_gate: Any = None,
) -> tuple[Any, Any]:
    """Spawn `receiver_main`; return (process, results queue)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    plain_jobs = [
        (
            {
                "transfer_id": t.transfer_id,
                "request_id": t.request_id,
                "num_blocks": t.num_blocks,
                "timeout_s": t.timeout_s,
                "checksum": t.checksum,
            },
            ids,
        )
        for t, ids in jobs
    ]
    process = context.Process(
        target=receiver_main,
        args=(
            plain_rendezvous(rendezvous),
            layout.to_json(),
            mode,
            plain_jobs,
            num_blocks,
            results,
            header_gate,
        ),
        daemon=True,
    )
    process.start()
    return process, results
