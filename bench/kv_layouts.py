"""Hand-off cost of one prompt's KV for three attention layouts: MHA, GQA and MLA (latent).

    .venv/bin/python -m bench.kv_layouts [--tokens 1024] [--layers 8] [--reps 5]
        [--transports gloo shm] [--out bench/results/kv_layouts.json]

The same prompt's cache moved over each transport this machine has, between a sender (this
process) and a receiver (a spawned process), as bench.kv_transfer moves blocks; bf16, blocks
of 16 tokens, every layout with the same number of layers. Per token and layer a cache holds:
- MHA: K and V of 128 heads of 128 (DeepSeek-V3's 128 query heads, were each to keep its own
  K and V of Llama's head size),
- GQA: K and V of 8 KV heads of 128 (Llama-3-70B's grouping, the baseline),
- MLA: one latent entry of 512 + 64 (DeepSeek-V3's kv_lora_rank and rope dims).
Each row is timed in the same run; the ratios are to GQA's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.kv_transfer import (
    TIMEOUT_S,
    Job,
    Session,
    machine_info,
    run_transport,
    transports_here,
)
from kv_transfer import KVCacheLayout, TransferTicket

BLOCK_SIZE = 16
BASELINE = "gqa"


def layouts(num_layers: int) -> dict[str, KVCacheLayout]:
    return {
        "mha": KVCacheLayout("bfloat16", BLOCK_SIZE, num_layers, num_kv_heads=128, head_dim=128),
        "gqa": KVCacheLayout("bfloat16", BLOCK_SIZE, num_layers, num_kv_heads=8, head_dim=128),
        "mla": KVCacheLayout(
            "bfloat16", BLOCK_SIZE, num_layers, num_kv_heads=1, head_dim=576, kv_planes=1
        ),
    }


def session(name: str, layout: KVCacheLayout, tokens: int, reps: int, seed: int) -> Session:
    """One prompt of ``tokens`` moved ``reps`` times after a warm-up, random block ids."""
    num_blocks = -(-tokens // BLOCK_SIZE)
    cache_blocks = 2 * num_blocks
    rng = random.Random(seed)
    jobs = [
        Job(
            "warmup" if rep == 0 else "timed",
            num_blocks * layout.block_nbytes / (1 << 20),
            TransferTicket(rep, f"{name}-{rep}", num_blocks, TIMEOUT_S),
            rng.sample(range(cache_blocks), num_blocks),
            rng.sample(range(cache_blocks), num_blocks),
        )
        for rep in range(reps + 1)
    ]
    return Session(name, layout, cache_blocks, jobs)


def summarize(sessions: list[Session], pairs: list[list[tuple[Any, Any]]], tokens: int) -> dict:
    rows: dict[str, dict[str, float]] = {}
    for s, moved in zip(sessions, pairs, strict=True):
        timed = [sent for job, (sent, _) in zip(s.jobs, moved) if job.label == "timed"]
        seconds = statistics.median(sent.total_s for sent in timed)
        rows[s.name] = {
            "bytes_per_token": s.layout.block_nbytes / BLOCK_SIZE,
            "bytes_per_token_per_layer": s.layout.block_nbytes / BLOCK_SIZE / s.layout.num_layers,
            "prompt_bytes": timed[0].nbytes,
            "hand_off_ms": seconds * 1e3,
            "gb_per_s": timed[0].nbytes / seconds / 1e9,
        }
    base = rows[BASELINE]
    for row in rows.values():
        row["bytes_vs_gqa"] = row["bytes_per_token"] / base["bytes_per_token"]
        row["time_vs_gqa"] = row["hand_off_ms"] / base["hand_off_ms"]
    return {"tokens": tokens, "layouts": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--transports", nargs="+", default=None)
    parser.add_argument("--out", default="bench/results/kv_layouts.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sessions = [
        session(name, layout, args.tokens, args.reps, seed)
        for seed, (name, layout) in enumerate(layouts(args.layers).items())
    ]
    result: dict[str, Any] = {
        "benchmark": "kv_layouts",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "config": {
            "tokens": args.tokens,
            "reps": args.reps,
            "layouts": {s.name: asdict(s.layout) for s in sessions},
        },
        "transports": {},
    }
    for transport, sender_device, receiver_device in transports_here():
        if args.transports and transport not in args.transports:
            continue
        print(f"running {transport} ({sender_device} -> {receiver_device}) ...", flush=True)
        pairs = run_transport(
            transport, sender_device, receiver_device, sessions, None, args.threads
        )
        result["transports"][transport] = summarize(sessions, pairs, args.tokens)
    for transport, summary in result["transports"].items():
        print(f"\n{transport}: one {args.tokens}-token prompt, {args.layers} layers, bf16")
        print(
            f"{'layout':6} {'B/token/layer':>14} {'MiB':>8} {'ms':>9} {'GB/s':>6} {'bytes':>7} {'time':>7}"
        )
        for name, row in summary["layouts"].items():
            print(
                f"{name:6} {row['bytes_per_token_per_layer']:14.0f} "
                f"{row['prompt_bytes'] / (1 << 20):8.1f} {row['hand_off_ms']:9.2f} "
                f"{row['gb_per_s']:6.2f} {row['bytes_vs_gqa']:6.3f}x {row['time_vs_gqa']:6.3f}x"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
