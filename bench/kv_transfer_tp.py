"""KV transfer between workers of different tensor-parallel sizes: bytes and GB/s per rank pair.

    .venv/bin/python -m bench.kv_transfer_tp [--tokens 1024] [--reps 5] [--threads N]
        [--transports gloo shm] [--out bench/results/kv_transfer_tp.json]

For a prefill worker of TP a and a decode worker of TP b, (a, b) in (1, 1), (2, 1), (1, 2),
(2, 2), every rank pair that `plan_head_moves` names gets its own channel, and moves its heads
of a hand-off of ``--tokens`` tokens in the Llama-3-8B layout (32 layers, 8 KV heads, head_dim
128, bf16, block 16: 128 MiB per 1k tokens at TP 1). The sender ranks live in this process, the
receiver ranks in one spawned process; the pairs run one after another (two cores cannot run
four ranks' copies side by side), each timed by its sender (`send_blocks` returns once the
blocks are in the receiver's cache). The baseline is torch `copy_` of one contiguous tensor of
the pair's bytes, in the same run. Per TP pair of workers: the bytes over all rank pairs, the
sum of their times (this machine, one pair at a time) and the slowest pair (the hand-off time
when every rank pair has cores of its own).
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.kv_transfer import (
    HANDOFF_LAYOUT,
    HOST,
    TIMEOUT_S,
    make_cache,
    memcpy_gbps,
    plain_rendezvous,
    rendezvous_of,
)
from bench.results_json import write_json
from engine.parallel.shard import rank_kv_heads
from kv_transfer import KVCacheLayout, KVChannel, TransferTicket
from kv_transfer.head_plan import HeadMove, plan_head_moves
from kv_transfer.layout import describe_heads

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@dataclass(frozen=True, slots=True)
class PairSession:
    """One rank pair's channel: its layouts, cache sizes and the transfers it runs."""

    tp: tuple[int, int]  # (prefill TP size, decode TP size)
    move: HeadMove  # which heads the pair moves
    sender_layout: KVCacheLayout
    receiver_layout: KVCacheLayout
    num_cache_blocks: int  # blocks of each end's cache
    jobs: list[tuple[TransferTicket, list[int], list[int]]]  # (ticket, src ids, dst ids); the
    # first is a warm-up


def rank_heads(num_kv_heads: int, size: int) -> list[range]:
    """Each rank's KV heads, as a worker of ``size`` ranks holds them."""
    return [rank_kv_heads(num_kv_heads, rank, size) for rank in range(size)]


def make_sessions(num_tokens: int, reps: int) -> list[PairSession]:
    model = HANDOFF_LAYOUT
    num_blocks = -(-num_tokens // model.block_size)
    rng = random.Random(0)
    sessions = []
    for prefill_size, decode_size in TP_PAIRS:
        prefill = rank_heads(model.num_kv_heads, prefill_size)
        decode = rank_heads(model.num_kv_heads, decode_size)
        # every rank of a worker shares its block table: one pair of id lists per hand-off
        ids = [
            (
                rng.sample(range(2 * num_blocks), num_blocks),
                rng.sample(range(2 * num_blocks), num_blocks),
            )
            for _ in range(reps + 1)
        ]
        for move in plan_head_moves(prefill, decode):
            held = (prefill[move.prefill_rank], decode[move.decode_rank])
            sender = _rank_layout(model, held[0]).moving(move.heads)
            receiver = _rank_layout(model, held[1]).moving(move.heads)
            jobs = [
                (TransferTicket(rep, f"tp-{rep}", num_blocks, TIMEOUT_S), src, dst)
                for rep, (src, dst) in enumerate(ids)
            ]
            sessions.append(
                PairSession(
                    (prefill_size, decode_size), move, sender, receiver, 2 * num_blocks, jobs
                )
            )
    return sessions


def _rank_layout(model: KVCacheLayout, heads: range) -> KVCacheLayout:
    return KVCacheLayout(
        model.dtype, model.block_size, model.num_layers, len(heads), model.head_dim
    ).holding(heads)


def receiver_main(
    rendezvous: list[dict[str, Any]], sessions: list[PairSession], threads: int, results: Any
) -> None:
    """The receiving ranks: one channel per rank pair, every job received in order."""
    torch.set_num_threads(threads)
    out = []
    for plain, session in zip(rendezvous, sessions):
        layout = session.receiver_layout
        cache = make_cache(layout, session.num_cache_blocks, "cpu")
        with KVChannel.connect(
            rendezvous_of(plain), layout, torch.device("cpu"), TIMEOUT_S
        ) as channel:
            out.append([asdict(channel.recv_blocks(cache, dst, t)) for t, _, dst in session.jobs])
    results.put(out)


def run_transport(transport: str, sessions: list[PairSession], threads: int) -> list[list[float]]:
    """Per rank pair, the sender's seconds per timed job."""
    cpu = torch.device("cpu")
    listeners = [
        KVChannel.listen(transport, s.sender_layout, HOST, f"tp-{transport}-{i}", cpu)
        for i, s in enumerate(sessions)
    ]
    plain = [plain_rendezvous(listener.rendezvous) for listener in listeners]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=receiver_main, args=(plain, sessions, threads, results), daemon=True
    )
    process.start()
    seconds = []
    for listener, session in zip(listeners, sessions):
        cache = make_cache(session.sender_layout, session.num_cache_blocks, "cpu")
        with listener, listener.accept(TIMEOUT_S) as channel:
            stats = [channel.send_blocks(cache, src, t) for t, src, _ in session.jobs]
        seconds.append([s.total_s for s in stats[1:]])
    results.get(timeout=TIMEOUT_S)
    process.join(60)
    return seconds


def summarize(sessions: list[PairSession], seconds: list[list[float]], reps: int) -> dict[str, Any]:
    whole_bytes = sessions[0].jobs[0][0].num_blocks * HANDOFF_LAYOUT.block_nbytes
    pairs: list[dict[str, Any]] = []
    workers: dict[str, dict[str, float]] = {}
    for session, times in zip(sessions, seconds):
        nbytes = session.jobs[0][0].num_blocks * session.sender_layout.moved_block_nbytes
        median = statistics.median(times)
        memcpy = memcpy_gbps(nbytes, "cpu", reps)
        label = f"{session.tp[0]}->{session.tp[1]}"
        pairs.append(
            {
                "tp": label,
                "prefill_rank": session.move.prefill_rank,
                "decode_rank": session.move.decode_rank,
                "heads": describe_heads(session.move.heads),
                "nbytes": nbytes,
                "share_of_tp1": nbytes / whole_bytes,
                "seconds": median,
                "gb_per_s": nbytes / median / 1e9,
                "memcpy_gb_per_s": memcpy,
                "fraction_of_memcpy": nbytes / median / 1e9 / memcpy,
            }
        )
        total = workers.setdefault(label, {"nbytes": 0, "sum_seconds": 0.0, "slowest_pair_s": 0.0})
        total["nbytes"] += nbytes
        total["sum_seconds"] += median
        total["slowest_pair_s"] = max(total["slowest_pair_s"], median)
    for total in workers.values():
        total["gb_per_s_one_pair_at_a_time"] = total["nbytes"] / total["sum_seconds"] / 1e9
    return {"pairs": pairs, "workers": workers}


def print_tables(result: dict[str, Any]) -> None:
    print(f"\n{'transport':<10}{'TP':>6}{'pair':>7}{'heads':>7}{'MiB':>8}{'GB/s':>8}{'memcpy':>8}")
    for transport, data in result["transports"].items():
        for row in data["pairs"]:
            pair = f"{row['prefill_rank']}->{row['decode_rank']}"
            print(
                f"{transport:<10}{row['tp']:>6}{pair:>7}{row['heads']:>7}"
                f"{row['nbytes'] / 2**20:>8.1f}{row['gb_per_s']:>8.2f}{row['memcpy_gb_per_s']:>8.2f}"
            )
    print(f"\n{'transport':<10}{'TP':>6}{'MiB':>8}{'sum ms':>9}{'slowest ms':>12}{'GB/s':>8}")
    for transport, data in result["transports"].items():
        for label, total in data["workers"].items():
            print(
                f"{transport:<10}{label:>6}{total['nbytes'] / 2**20:>8.1f}"
                f"{total['sum_seconds'] * 1e3:>9.1f}{total['slowest_pair_s'] * 1e3:>12.1f}"
                f"{total['gb_per_s_one_pair_at_a_time']:>8.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--transports", nargs="+", default=["gloo", "shm"])
    parser.add_argument("--out", default="bench/results/kv_transfer_tp.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sessions = make_sessions(args.tokens, args.reps)
    result: dict[str, Any] = {
        "benchmark": "kv_transfer_tp",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "config": {"layout": HANDOFF_LAYOUT.to_json(), "tokens": args.tokens, "reps": args.reps},
        "transports": {},
    }
    for transport in args.transports:
        print(f"running {transport} ...", flush=True)
        seconds = run_transport(transport, sessions, args.threads)
        result["transports"][transport] = summarize(sessions, seconds, args.reps)
    print_tables(result)
    print(f"\nwrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
