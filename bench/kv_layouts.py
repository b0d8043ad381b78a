"""Hand-off cost of one prompt's KV for four attention layouts: MHA, GQA, MLA (latent), and
GQA whose every other layer slides (gpt-oss's pattern).

    .venv/bin/python -m bench.kv_layouts [--tokens 1024] [--layers 8] [--reps 5]
        [--transports gloo shm] [--out bench/results/kv_layouts.json]

The same prompt's cache moved over each transport this machine has, between a sender (this
process) and a receiver (a spawned process), as bench.kv_transfer moves blocks; bf16, blocks
of 16 tokens, every layout with the same number of layers. Per token and layer a cache holds:
- MHA: K and V of 128 heads of 128 (DeepSeek-V3's 128 query heads, were each to keep its own
  K and V of Llama's head size),
- GQA: K and V of 8 KV heads of 128 (Llama-3-70B's grouping, the baseline),
- MLA: one latent entry of 512 + 64 (DeepSeek-V3's kv_lora_rank and rope dims),
- GQA windowed: GQA's heads, every other layer seeing only the last 128 positions (gpt-oss's
  window and pattern): its full and sliding layers keep block tables of their own (KV cache
  groups, engine/kv_cache/cache_groups.py), so a hand-off moves every block of the full
  layers and only the window's blocks of the sliding ones (as many as the engine's block
  manager says); GQA's row is what it moved when one table served every layer,
- GQA fp8 / GQA int8: GQA's heads in a quantized KV cache (``--kv-cache-dtype``), a byte an
  element: the channel moves the 8-bit blocks as they are (their per-head scales are agreed
  at the handshake, not moved per prompt).
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
from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.cache_groups import cache_groups_for
from kv_transfer import KVCacheLayout, TransferTicket

BLOCK_SIZE = 16
BASELINE = "gqa"
WINDOW = 128  # gpt-oss's sliding window, on every other layer


def layouts(num_layers: int, tokens: int) -> dict[str, tuple[KVCacheLayout, int]]:
    """Each layout and the blocks one ``tokens``-token prompt's hand-off moves in it."""
    num_blocks = -(-tokens // BLOCK_SIZE)
    scales = tuple(((1.0,) * 8, (1.0,) * 8) for _ in range(num_layers))  # any: never read here
    windowed = cache_groups_for(num_layers, WINDOW, tuple(range(0, num_layers, 2)))
    manager = BlockManager(1, BLOCK_SIZE, enable_prefix_caching=False, cache_groups=windowed)
    return {
        "mha": (
            KVCacheLayout("bfloat16", BLOCK_SIZE, num_layers, num_kv_heads=128, head_dim=128),
            num_blocks,
        ),
        "gqa": (
            KVCacheLayout("bfloat16", BLOCK_SIZE, num_layers, num_kv_heads=8, head_dim=128),
            num_blocks,
        ),
        "mla": (
            KVCacheLayout(
                "bfloat16", BLOCK_SIZE, num_layers, num_kv_heads=1, head_dim=576, kv_planes=1
            ),
            num_blocks,
        ),
        "gqa-windowed": (
            KVCacheLayout(
                "bfloat16",
                BLOCK_SIZE,
                windowed.num_slots,
                num_kv_heads=8,
                head_dim=128,
                cache_groups=windowed.handshake_name,
            ),
            manager.num_blocks_to_hand_off(tokens),
        ),
        **{
            f"gqa-{name}": (
                KVCacheLayout(
                    dtype, BLOCK_SIZE, num_layers, num_kv_heads=8, head_dim=128, kv_scales=scales
                ),
                num_blocks,
            )
            for name, dtype in (("fp8", "float8_e4m3fn"), ("int8", "int8"))
        },
    }


def session(name: str, layout: KVCacheLayout, num_blocks: int, reps: int, seed: int) -> Session:
    """One prompt's ``num_blocks`` moved ``reps`` times after a warm-up, random block ids."""
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


def summarize(
    sessions: list[Session], pairs: list[list[tuple[Any, Any]]], tokens: int, num_layers: int
) -> dict:
    rows: dict[str, dict[str, float]] = {}
    for s, moved in zip(sessions, pairs, strict=True):
        timed = [sent for job, (sent, _) in zip(s.jobs, moved) if job.label == "timed"]
        seconds = statistics.median(sent.total_s for sent in timed)
        rows[s.name] = {
            "blocks_moved": timed[0].nbytes / s.layout.block_nbytes,
            "bytes_per_token": timed[0].nbytes / tokens,
            "bytes_per_token_per_layer": timed[0].nbytes / tokens / num_layers,
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
        session(name, layout, num_blocks, args.reps, seed)
        for seed, (name, (layout, num_blocks)) in enumerate(
            layouts(args.layers, args.tokens).items()
        )
    ]
    result: dict[str, Any] = {
        "benchmark": "kv_layouts",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "config": {
            "tokens": args.tokens,
            "layers": args.layers,
            "window": WINDOW,
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
        result["transports"][transport] = summarize(sessions, pairs, args.tokens, args.layers)
    for transport, summary in result["transports"].items():
        print(
            f"\n{transport}: one {args.tokens}-token prompt, {args.layers} layers, bf16 "
            "(fp8, int8: 8-bit caches)"
        )
        print(
            f"{'layout':12} {'B/token/layer':>14} {'MiB':>8} {'ms':>9} {'GB/s':>6} {'bytes':>7} "
            f"{'time':>7}"
        )
        for name, row in summary["layouts"].items():
            print(
                f"{name:12} {row['bytes_per_token_per_layer']:14.0f} "
                f"{row['prompt_bytes'] / (1 << 20):8.1f} {row['hand_off_ms']:9.2f} "
                f"{row['gb_per_s']:6.2f} {row['bytes_vs_gqa']:6.3f}x {row['time_vs_gqa']:6.3f}x"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
