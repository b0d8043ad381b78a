"""KV transfer: end-to-end block-transfer bandwidth per transport, beside a plain memcpy.

    .venv/bin/python -m bench.kv_transfer [--sizes-mb 1 4 16 64 256 512] [--reps 5]
        [--chunk-mb N] [--threads N] [--transports gloo shm] [--out bench/results/kv_transfer.json]

For each transport this machine has (gloo and shm on CPU; cuda_ipc with one GPU, nccl with
two), a sender (this process) and a receiver (a spawned process) open a channel and move
random, non-contiguous block lists of each size, timed by the sender (`send_blocks` returns
once the blocks are in the receiver's cache): gather + wire + scatter for gloo, shm and nccl,
one copy out of the sender's mapped cache for cuda_ipc. The baseline is torch `copy_` of one
contiguous tensor of the same size into another, in the same run and on the same device.
Sweep layout: bf16, block 16, 8 layers, 8 KV heads, head_dim 128 (0.5 MiB per block).

Also a hand-off latency breakdown for a 1k-token prompt of a Llama-3-8B-shaped cache (32
layers, 8 KV heads, head_dim 128, bf16, block 16: 64 blocks, 128 MiB): gather, send (wire),
scatter, end to end. Chunks are pipelined, so the phases overlap and need not add up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kv_transfer import ChannelRendezvous, KVCacheLayout, KVChannel, TransferStats, TransferTicket
from kv_transfer.transports import DEFAULT_CHUNK_BYTES

MIB = 1 << 20
SWEEP_LAYOUT = KVCacheLayout("bfloat16", block_size=16, num_layers=8, num_kv_heads=8, head_dim=128)
HANDOFF_LAYOUT = KVCacheLayout(
    "bfloat16", block_size=16, num_layers=32, num_kv_heads=8, head_dim=128
)
HANDOFF_TOKENS = 1024
TIMEOUT_S = 300.0
HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Job:
    label: str  # "warmup" or "timed"
    size_mb: float  # payload size
    ticket: TransferTicket
    src_ids: list[int]
    dst_ids: list[int]


@dataclass(frozen=True, slots=True)
class Session:
    """One channel: a layout, cache sizes on both ends and the transfers to run on it."""

    name: str  # "sweep" | "handoff"
    layout: KVCacheLayout
    num_cache_blocks: int
    jobs: list[Job]


def machine_info() -> dict[str, Any]:
    """The CPU, torch's threads and version, and the GPU if any: each result's "machine"."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def transports_here() -> list[tuple[str, str, str]]:
    """(transport, sender device, receiver device) for what this machine can run."""
    found = [("gloo", "cpu", "cpu"), ("shm", "cpu", "cpu")]
    if torch.cuda.is_available():
        found.append(("cuda_ipc", "cuda:0", "cuda:0"))
        if torch.cuda.device_count() >= 2:
            found.append(("nccl", "cuda:0", "cuda:1"))
    return found


def make_jobs(
    layout: KVCacheLayout, sizes_mb: list[float], reps: int, num_cache_blocks: int, seed: int
) -> list[Job]:
    rng = random.Random(seed)
    jobs: list[Job] = []
    for size_mb in sizes_mb:
        num_blocks = max(1, round(size_mb * MIB / layout.block_nbytes))
        for rep in range(reps + 1):
            ticket = TransferTicket(len(jobs), f"bench-{size_mb}-{rep}", num_blocks, TIMEOUT_S)
            src_ids = rng.sample(range(num_cache_blocks), num_blocks)
            dst_ids = rng.sample(range(num_cache_blocks), num_blocks)
            jobs.append(Job("warmup" if rep == 0 else "timed", size_mb, ticket, src_ids, dst_ids))
    return jobs


def make_sessions(sizes_mb: list[float], reps: int) -> list[Session]:
    sweep_blocks = int(max(sizes_mb) * MIB / SWEEP_LAYOUT.block_nbytes * 1.25) + 8
    handoff_blocks = HANDOFF_TOKENS // HANDOFF_LAYOUT.block_size
    handoff_mb = handoff_blocks * HANDOFF_LAYOUT.block_nbytes / MIB
    return [
        Session(
            "sweep",
            SWEEP_LAYOUT,
            sweep_blocks,
            make_jobs(SWEEP_LAYOUT, sizes_mb, reps, sweep_blocks, seed=0),
        ),
        Session(
            "handoff",
            HANDOFF_LAYOUT,
            2 * handoff_blocks,
            make_jobs(HANDOFF_LAYOUT, [handoff_mb], max(reps, 5), 2 * handoff_blocks, seed=1),
        ),
    ]


def make_cache(layout: KVCacheLayout, num_blocks: int, device: str) -> torch.Tensor:
    """A touched (page-faulted) cache; the values do not matter here, the tests check bits."""
    shape = layout.cache_shape(num_blocks)
    return torch.full(shape, 0.5, dtype=layout.torch_dtype, device=device)


def plain_rendezvous(rendezvous: ChannelRendezvous) -> dict[str, Any]:
    """A rendezvous as plain lists and dicts, to hand to the receiving process."""
    return {**asdict(rendezvous), "extra": [list(pair) for pair in rendezvous.extra]}


def rendezvous_of(plain: dict[str, Any]) -> ChannelRendezvous:
    """The rendezvous ``plain_rendezvous`` gave."""
    return ChannelRendezvous(**{**plain, "extra": tuple(tuple(pair) for pair in plain["extra"])})


def receiver_main(
    rendezvous: list[dict[str, Any]],
    sessions: list[Session],
    device: str,
    threads: int,
    results: Any,
) -> None:
    """The receiving process: one channel per session, every job received in order."""
    torch.set_num_threads(threads)
    out: list[list[dict[str, Any]]] = []
    for plain, session in zip(rendezvous, sessions):
        cache = make_cache(session.layout, session.num_cache_blocks, device)
        with KVChannel.connect(
            rendezvous_of(plain), session.layout, torch.device(device), TIMEOUT_S
        ) as channel:
            out.append(
                [
                    asdict(channel.recv_blocks(cache, job.dst_ids, job.ticket))
                    for job in session.jobs
                ]
            )
        del cache
    results.put(out)


def run_transport(
    transport: str,
    sender_device: str,
    receiver_device: str,
    sessions: list[Session],
    chunk_bytes: int | None,
    threads: int,
) -> list[list[tuple[Any, Any]]]:
    """Per session, per job: (sender stats, receiver stats as a dict)."""
    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    listeners = [
        KVChannel.listen(
            transport,
            s.layout,
            HOST,
            f"bench-{transport}-{s.name}",
            torch.device(sender_device),
            **options,
        )
        for s in sessions
    ]
    plain = [plain_rendezvous(listener.rendezvous) for listener in listeners]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=receiver_main,
        args=(plain, sessions, receiver_device, threads, results),
        daemon=True,
    )
    process.start()
    sent: list[list[TransferStats]] = []
    for listener, session in zip(listeners, sessions):
        cache = make_cache(session.layout, session.num_cache_blocks, sender_device)
        with listener, listener.accept(TIMEOUT_S) as channel:
            sent.append(
                [channel.send_blocks(cache, job.src_ids, job.ticket) for job in session.jobs]
            )
        del cache
    received = results.get(timeout=TIMEOUT_S)
    process.join(60)
    return [list(zip(s, r)) for s, r in zip(sent, received)]


def memcpy_gbps(nbytes: int, device: str, reps: int) -> float:
    """Median GB/s of `dst.copy_(src)`, both contiguous and already touched."""
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(reps + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


def summarize_sweep(
    session: Session, pairs: list[tuple[Any, Any]], device: str, reps: int
) -> list[dict[str, Any]]:
    rows = []
    for size_mb in sorted({job.size_mb for job in session.jobs}):
        timed = [
            (s, r)
            for job, (s, r) in zip(session.jobs, pairs)
            if job.size_mb == size_mb and job.label == "timed"
        ]
        nbytes = timed[0][0].nbytes
        seconds = statistics.median(s.total_s for s, _ in timed)
        # the receiver's copy into its blocks (cuda_ipc: the block-copy kernel, synchronised),
        # and the time the sender's call spent outside it: the control round trip and staging
        scatter_s = statistics.median(r["scatter_s"] for _, r in timed)
        memcpy = memcpy_gbps(nbytes, device, reps)
        rows.append(
            {
                "size_mb": size_mb,
                "nbytes": nbytes,
                "seconds": seconds,
                "gb_per_s": nbytes / seconds / 1e9,
                "memcpy_gb_per_s": memcpy,
                "fraction_of_memcpy": nbytes / seconds / 1e9 / memcpy,
                "receiver_scatter_ms": scatter_s * 1e3,
                "scatter_gb_per_s": nbytes / scatter_s / 1e9 if scatter_s > 0 else None,
                "outside_scatter_ms": (seconds - scatter_s) * 1e3,
            }
        )
    return rows


def summarize_handoff(session: Session, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    timed = [(s, r) for job, (s, r) in zip(session.jobs, pairs) if job.label == "timed"]

    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    return {
        "tokens": HANDOFF_TOKENS,
        "nbytes": timed[0][0].nbytes,
        "num_chunks": timed[0][0].num_chunks,
        "gather_ms": median_ms([s.gather_s for s, _ in timed]),
        "send_wire_ms": median_ms([s.wire_s for s, _ in timed]),
        "scatter_ms": median_ms([r["scatter_s"] for _, r in timed]),
        "recv_wire_ms": median_ms([r["wire_s"] for _, r in timed]),
        "end_to_end_ms": median_ms([s.total_s for s, _ in timed]),
    }


def print_tables(result: dict[str, Any]) -> None:
    print(f"\n{'transport':<10}{'MiB':>6}{'GB/s':>9}{'memcpy':>9}{'ratio':>8}")
    for transport, data in result["transports"].items():
        for row in data["sweep"]:
            print(
                f"{transport:<10}{row['size_mb']:>6g}{row['gb_per_s']:>9.2f}"
                f"{row['memcpy_gb_per_s']:>9.2f}{row['fraction_of_memcpy']:>8.0%}"
            )
    print(f"\nhand-off of a {HANDOFF_TOKENS}-token prompt, Llama-3-8B layout (ms, medians)")
    print(
        f"{'transport':<10}{'gather':>8}{'send':>8}{'scatter':>9}{'recv':>8}{'e2e':>8}{'GB/s':>7}"
    )
    for transport, data in result["transports"].items():
        h = data["handoff"]
        print(
            f"{transport:<10}{h['gather_ms']:>8.1f}{h['send_wire_ms']:>8.1f}"
            f"{h['scatter_ms']:>9.1f}{h['recv_wire_ms']:>8.1f}{h['end_to_end_ms']:>8.1f}"
            f"{h['nbytes'] / h['end_to_end_ms'] / 1e6:>7.2f}"
        )


def reserve_ms(num_blocks: int, reps: int = 200) -> float:
    """Median time for a decode engine to reserve (and give back) a prompt's blocks.

    This is the decode side's own work; in the cluster the reservation is also one Ray actor
    call from the prefill worker (about 0.7 ms round trip here, see ENVIRONMENT.md).
    """
    from engine.kv_cache.block_pool import BlockPool

    pool = BlockPool(num_blocks * 64, enable_prefix_caching=True)
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        blocks = [pool.allocate() for _ in range(num_blocks)]
        samples.append(time.perf_counter() - started)
        for block in blocks:
            pool.free(block)
    return 1000 * statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256, 512])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk-mb", type=float, default=None, help="default: per transport")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--transports", nargs="+", default=None)
    parser.add_argument("--out", default="bench/results/kv_transfer.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunk_bytes = None if args.chunk_mb is None else int(args.chunk_mb * MIB)
    sessions = make_sessions(args.sizes_mb, args.reps)
    result: dict[str, Any] = {
        "benchmark": "kv_transfer",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "config": {
            "sweep_layout": asdict(SWEEP_LAYOUT),
            "handoff_layout": asdict(HANDOFF_LAYOUT),
            "chunk_mb": args.chunk_mb or {t: n / MIB for t, n in DEFAULT_CHUNK_BYTES.items()},
            "reps": args.reps,
        },
        "transports": {},
    }
    for transport, sender_device, receiver_device in transports_here():
        if args.transports and transport not in args.transports:
            continue
        print(f"running {transport} ({sender_device} -> {receiver_device}) ...", flush=True)
        sweep, handoff = run_transport(
            transport, sender_device, receiver_device, sessions, chunk_bytes, args.threads
        )
        result["transports"][transport] = {
            "devices": [sender_device, receiver_device],
            "sweep": summarize_sweep(sessions[0], sweep, sender_device, args.reps),
            "handoff": summarize_handoff(sessions[1], handoff),
        }
    handoff_blocks = HANDOFF_TOKENS // HANDOFF_LAYOUT.block_size
    result["handoff_reserve_ms"] = reserve_ms(handoff_blocks)
    print_tables(result)
    print(f"reserve ({handoff_blocks} blocks, decode side): {result['handoff_reserve_ms']:.3f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
