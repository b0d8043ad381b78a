"""Latent attention (MLA) on CPU: the CPU backend's C kernels against the torch reference, in
the same run.

    .venv/bin/python -m bench.cpu_latent_attention [--threads 1] [--out FILE.json]

One layer of a latent cache (one entry a position: the latent and its rotary part, read as both
keys and values), each sequence's blocks scattered over the cache. The C kernels are
``CpuAttentionBackend.forward_latent`` (every row through the prefill kernel: a decode row is a
prompt of one token); the baseline is ``TorchAttentionBackend.forward_latent`` (each sequence's
context gathered into a buffer, then torch's scaled_dot_product_attention). Cases: decode
batches of 16 and 64 sequences and a 512-token prompt, over entries of 288 (a latent of 256 and
32 rotary: ``bench.offline_throughput --model mla``'s) and of 576 (512 and 64: DeepSeek-V2-Lite's
and V3's), 16 query heads. Prints a table and writes JSON; speedup is the reference's time over
the kernels'.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.results_json import write_json
from bench.timing import median_seconds
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    context: int  # each sequence's, the new tokens included
    new_tokens: int  # each sequence's (1: decode rows)
    num_heads: int
    width: int  # an entry's elements: the latent and its rotary part
    value_dim: int  # of which the values (the latent)

    @property
    def flop(self) -> float:
        """Multiply-adds of the scores (over the whole width) and the values (the latent) over
        the causal pairs, times 2."""
        cached = self.context - self.new_tokens
        pairs = self.new_tokens * cached + self.new_tokens * (self.new_tokens + 1) / 2
        return 2 * self.num_seqs * self.num_heads * pairs * (self.width + self.value_dim)


CASES = [
    Case("decode", 16, 1024, 1, 16, 288, 256),
    Case("decode", 64, 512, 1, 16, 288, 256),
    Case("decode", 16, 1024, 1, 16, 576, 512),
    Case("prefill", 1, 512, 512, 16, 288, 256),
    Case("prefill", 1, 512, 512, 16, 576, 512),
]


def _runners(case: Case) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(the C kernels, the reference) over one batch of the case."""
    generator = torch.Generator().manual_seed(case.num_seqs * case.context + case.width)
    blocks_per_seq = -(-case.context // BLOCK_SIZE)
    num_blocks = case.num_seqs * blocks_per_seq + 8
    cache = torch.randn(1, num_blocks, BLOCK_SIZE, 1, case.width, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: case.num_seqs * blocks_per_seq]
    tables = tables.view(case.num_seqs, blocks_per_seq).clone()
    positions = torch.arange(case.context - case.new_tokens, case.context)
    slots = tables[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    prefill = case.new_tokens > 1
    metadata = AttentionMetadata(
        num_prefill_seqs=case.num_seqs if prefill else 0,
        num_prefill_tokens=case.num_seqs * case.new_tokens if prefill else 0,
        num_decode_seqs=0 if prefill else case.num_seqs,
        slot_mapping=slots.reshape(-1),
        prefill_query_start_loc=(
            [i * case.new_tokens for i in range(case.num_seqs + 1)] if prefill else [0]
        ),
        prefill_seq_lens=[case.context] * case.num_seqs if prefill else [],
        prefill_block_tables=tables if prefill else tables[:0],
        decode_seq_lens=torch.full((0 if prefill else case.num_seqs,), case.context),
        decode_block_tables=tables[:0] if prefill else tables,
        max_decode_seq_len=0 if prefill else case.context,
    )
    query = torch.randn(
        case.num_seqs * case.new_tokens, case.num_heads, case.width, generator=generator
    )
    scale = case.width**-0.5
    kernels, reference = CpuAttentionBackend(), TorchAttentionBackend()

    def run_kernels() -> torch.Tensor:
        return kernels.forward_latent(query, cache, metadata, scale, case.value_dim)

    def run_reference() -> torch.Tensor:
        return reference.forward_latent(query, cache, metadata, scale, case.value_dim)

    return run_kernels, run_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results/cpu_latent_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{'case':>8} {'seqs':>5} {'new':>4} {'context':>7} {'width':>5} {'kernels ms':>10} "
        f"{'ref ms':>8} {'kernels GF/s':>12} {'ref GF/s':>8} speedup"
    )
    rows: list[dict[str, object]] = []
    for case in CASES:
        kernels, reference = _runners(case)
        torch.testing.assert_close(kernels(), reference(), atol=1e-4, rtol=1e-4)
        kernels_ms = median_seconds(kernels, args.repeats) * 1e3
        reference_ms = median_seconds(reference, args.repeats) * 1e3
        kernels_gf, reference_gf = case.flop / kernels_ms / 1e6, case.flop / reference_ms / 1e6
        print(
            f"{case.name:>8} {case.num_seqs:>5} {case.new_tokens:>4} {case.context:>7} "
            f"{case.width:>5} {kernels_ms:10.3f} {reference_ms:8.3f} {kernels_gf:12.1f} "
            f"{reference_gf:8.1f} {reference_ms / kernels_ms:6.2f}x"
        )
        rows.append(
            {
                "case": case.name,
                "num_seqs": case.num_seqs,
                "new_tokens": case.new_tokens,
                "context": case.context,
                "heads": case.num_heads,
                "width": case.width,
                "value_dim": case.value_dim,
                "kernels_ms": kernels_ms,
                "reference_ms": reference_ms,
                "kernels_gflop_per_s": kernels_gf,
                "reference_gflop_per_s": reference_gf,
                "speedup": reference_ms / kernels_ms,
            }
        )
    payload = {
        "benchmark": "cpu_latent_attention",
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "block_size": BLOCK_SIZE,
        "results": rows,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
