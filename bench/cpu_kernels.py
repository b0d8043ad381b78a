"""The C kernels on CPU: on one thread against torch's intra-op threads, in the same run.

    .venv/bin/python -m bench.cpu_kernels [--threads 2] [--out bench/results/cpu_kernels.json]

Decode attention over a paged cache laid out like a busy server's (each sequence's blocks
scattered over a 2048-block cache, contexts of 100-350 tokens, the demo model's 4 heads of 64)
at batch 16, 48 and 80; and the elementwise kernels at 80 rows (a decode step) and 2048 rows (a
full prefill step). Each is timed with one thread, the baseline, and with ``--threads``; both
give the same bits. Prints a table and writes JSON; speedup is the one-thread time over the
threaded one.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable

import torch

from bench.results_json import write_json
from bench.timing import median_seconds
from engine.kernels.cpu import elementwise
from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu

NUM_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 64, 16, 2048
HIDDEN, INTERMEDIATE = 256, 704


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def _decode_case(batch_size: int, seed: int) -> Callable[[int], torch.Tensor]:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, generator=generator)
    seq_lens = [rng.randint(100, 350) for _ in range(batch_size)]
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = torch.zeros(batch_size, -(-max(seq_lens) // BLOCK_SIZE), dtype=torch.int64)
    for row, seq_len in enumerate(seq_lens):
        count = -(-seq_len // BLOCK_SIZE)
        tables[row, :count] = torch.tensor(free[:count])
        free = free[count:]
    query = torch.randn(batch_size, NUM_HEADS, HEAD_DIM, generator=generator)
    lens = torch.tensor(seq_lens)
    return lambda threads: paged_decode_attention_cpu(
        query, cache, tables, lens, HEAD_DIM**-0.5, num_threads=threads
    )


def _elementwise_cases(rows: int) -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, HIDDEN, generator=generator)
    weight = torch.randn(HIDDEN, generator=generator)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=generator)
    qkv = torch.randn(rows, 3 * NUM_HEADS, HEAD_DIM, generator=generator)
    query, key = qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS : 2 * NUM_HEADS]
    cos, sin = torch.randn(2, rows, 1, HEAD_DIM // 2, generator=generator)
    return {
        "add_rms_norm": lambda: elementwise.add_rms_norm(residual, x, weight, 1e-5),
        "rotary": lambda: elementwise.rotary_(query, key, cos, sin),
        "silu_and_mul": lambda: elementwise.silu_and_mul(gate_up),
    }


def _row(kernel: str, size: int, one_ms: float, threaded_ms: float) -> dict[str, object]:
    speedup = one_ms / threaded_ms
    print(f"{kernel:>16} {size:>6} {one_ms:10.3f} {threaded_ms:10.3f} {speedup:8.2f}x")
    return {
        "kernel": kernel,
        "size": size,
        "one_thread_ms": one_ms,
        "threaded_ms": threaded_ms,
        "speedup": speedup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=max(torch.get_num_threads(), 2))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="bench/results/cpu_kernels.json")
    args = parser.parse_args()
    print(f"{'kernel':>16} {'size':>6} {'1 thread':>10} {f'{args.threads} threads':>10} speedup")
    rows = []
    for batch_size in (16, 48, 80):
        attend = _decode_case(batch_size, seed=batch_size)
        assert torch.equal(attend(1), attend(args.threads))
        one = _median_ms(functools.partial(attend, 1), args.repeats)
        threaded = _median_ms(functools.partial(attend, args.threads), args.repeats)
        rows.append(_row("decode_attention", batch_size, one, threaded))
    for num_rows in (80, 2048):
        for kernel, run in _elementwise_cases(num_rows).items():
            torch.set_num_threads(1)  # the elementwise kernels use torch's thread count
            one = _median_ms(run, args.repeats)
            torch.set_num_threads(args.threads)
            threaded = _median_ms(run, args.repeats)
            rows.append(_row(kernel, num_rows, one, threaded))
    payload = {
        "benchmark": "cpu_kernels",
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "sizes": "decode_attention: batch size; others: rows",
        "results": rows,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
