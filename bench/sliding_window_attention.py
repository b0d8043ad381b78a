"""Sliding-window attention on the CPU kernels: a windowed layer against a full one, same run.

    .venv/bin/python -m bench.sliding_window_attention [--threads 1] [--out bench/results/x.json]

A Llama-3-8B-shaped layer (32 query heads, 8 KV heads of 128, blocks of 16, float32, blocks
scattered over the cache). Decode: 8 sequences, one new token each, at a 4096-token context.
Prefill: 1024 new tokens after a cached prefix of 1024. Each case runs with no window (the
baseline: the whole context) and with windows of 512 and 1024; medians of repeated calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu
from engine.kernels.cpu.paged_prefill_attention import paged_prefill_attention_cpu

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 32, 8, 128
WINDOWS = (None, 512, 1024)


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _cache(num_blocks: int, generator: torch.Generator) -> torch.Tensor:
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=generator)


def decode_case(num_seqs: int, context: int, threads: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = context // BLOCK_SIZE
    cache = _cache(num_seqs * blocks_per_seq, generator)
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=generator)
    tables = tables.view(num_seqs, blocks_per_seq).contiguous()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int64)
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator)
    return {
        str(window): _median_ms(
            lambda window=window: paged_decode_attention_cpu(
                query, cache, tables, seq_lens, HEAD_DIM**-0.5, threads, sliding_window=window
            ),
            repeats,
        )
        for window in WINDOWS
    }


def prefill_case(new_tokens: int, cached: int, threads: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(1)
    context = cached + new_tokens
    cache = _cache(context // BLOCK_SIZE, generator)
    tables = torch.randperm(context // BLOCK_SIZE, generator=generator)[None].contiguous()
    starts = torch.tensor([0, new_tokens], dtype=torch.int64)
    seq_lens = torch.tensor([context], dtype=torch.int64)
    query = torch.randn(new_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    return {
        str(window): _median_ms(
            lambda window=window: paged_prefill_attention_cpu(
                query,
                cache,
                tables,
                starts,
                seq_lens,
                HEAD_DIM**-0.5,
                threads,
                sliding_window=window,
            ),
            repeats,
        )
        for window in WINDOWS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench/results/sliding_window_attention.json")
    args = parser.parse_args()
    cases = {
        "decode 8 seqs at 4096": decode_case(8, 4096, args.threads, args.repeats),
        "prefill 1024 new after 1024 cached": prefill_case(1024, 1024, args.threads, 3),
    }
    for name, times in cases.items():
        whole = times["None"]
        parts = ", ".join(
            f"W={window} {ms:.2f} ms ({whole / ms:.1f}x)"
            for window, ms in times.items()
            if window != "None"
        )
        print(f"{name}: whole context {whole:.2f} ms; {parts}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "sliding_window_attention",
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "median_ms": cases,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
