"""Prefill attention on CPU: the C kernel against the torch path it replaced, in the same run.

    .venv/bin/python -m bench.cpu_prefill_attention [--threads 1] [--out FILE.json]

The baseline is the torch reference backend's prefill: gather the sequence's blocks into a
buffer, then torch's scaled_dot_product_attention (flash attention for CPU). Cases: the demo
model's 4 heads of 64 (whole prompts of 64-2048 tokens, and 256 new tokens after 768 cached,
as a prefix-cache hit or a later chunk), and Llama-3-8B's 32 query / 8 KV heads of 128; and
1-4 new tokens after a long context (items of few rows). Each sequence's blocks are scattered over the cache. Then the demo model's whole prefill step
(``max_tokens=1``, 256-token prompt, one at a time): the ``cpu`` backend against ``torch``.
Prints a table and writes JSON; speedup is the torch time over the kernel's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.results_json import write_json
from bench.timing import median_seconds
from engine.attention.torch_ref import _prefill_attention
from engine.kernels.cpu.paged_prefill_attention import paged_prefill_attention_cpu

BLOCK_SIZE = 16
DEMO_MODEL = Path(__file__).resolve().parents[1] / "engine" / "demo_model" / "assets"


@dataclass(frozen=True)
class Case:
    name: str
    query_len: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def flop(self) -> float:
        """Multiply-adds of QK^T and PV over the causal (visible) pairs, times 2."""
        cached = self.seq_len - self.query_len
        pairs = self.query_len * cached + self.query_len * (self.query_len + 1) / 2
        return 4 * self.num_heads * self.head_dim * pairs


CASES = [
    Case("demo", 64, 64, 4, 4, 64),
    Case("demo", 256, 256, 4, 4, 64),
    Case("demo", 1024, 1024, 4, 4, 64),
    Case("demo", 2048, 2048, 4, 4, 64),
    Case("demo", 256, 1024, 4, 4, 64),
    Case("llama-3-8b", 256, 256, 32, 8, 128),
    Case("llama-3-8b", 512, 1536, 32, 8, 128),
    # items of few rows (scores with K in place): a short chunk or prompt after a long context
    Case("demo", 4, 1024, 4, 4, 64),
    Case("llama-3-8b", 1, 2048, 32, 8, 128),
    Case("llama-3-8b", 2, 1024, 32, 8, 128),
]


def _runners(case: Case) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(kernel, torch path) for one sequence whose blocks lie scattered in a larger cache."""
    generator = torch.Generator().manual_seed(case.seq_len + case.num_heads)
    num_seq_blocks = -(-case.seq_len // BLOCK_SIZE)
    num_blocks = 2 * num_seq_blocks + 8
    cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_dim, generator=generator
    )
    table = torch.randperm(num_blocks, generator=generator)[:num_seq_blocks][None].clone()
    query = torch.randn(case.query_len, case.num_heads, case.head_dim, generator=generator)
    starts = torch.tensor([0, case.query_len])
    lens = torch.tensor([case.seq_len])
    scale = case.head_dim**-0.5
    blocks = cache.view(2, num_blocks, -1)
    kv_shape = (2, num_seq_blocks * BLOCK_SIZE, case.num_kv_heads, case.head_dim)

    def kernel() -> torch.Tensor:
        return paged_prefill_attention_cpu(query, cache, table, starts, lens, scale)

    def torch_path() -> torch.Tensor:
        kv = torch.index_select(blocks, 1, table[0]).view(kv_shape)[:, : case.seq_len]
        return _prefill_attention(query, kv, scale)

    return kernel, torch_path


def _prefill_step_ms(backend: str, repeats: int) -> float:
    """Median wall time of ``LLM.generate`` of one 256-token prompt to one token."""
    from engine import LLM, SamplingParams

    llm = LLM(str(DEMO_MODEL), dtype="float32", device="cpu", attention_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = iter(range(10**6))

    def one() -> None:  # a new prompt each call: no prefix-cache hit
        first = next(prompts)
        llm.generate([[(first * 7 + i) % 4000 + 10 for i in range(256)]], params)

    return median_seconds(one, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results/cpu_prefill_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = f"{'case':>11} {'new':>5} {'context':>7} {'kernel ms':>10} {'torch ms':>9}"
    print(f"{header} {'kernel GF/s':>11} {'torch GF/s':>10} speedup")
    rows: list[dict[str, object]] = []
    for case in CASES:
        kernel, torch_path = _runners(case)
        torch.testing.assert_close(kernel(), torch_path(), atol=1e-4, rtol=1e-4)
        repeats = max(3, args.repeats // (1 + case.num_heads * case.seq_len // 8192))
        kernel_ms = median_seconds(kernel, repeats) * 1e3
        torch_ms = median_seconds(torch_path, repeats) * 1e3
        kernel_gf, torch_gf = case.flop / kernel_ms / 1e6, case.flop / torch_ms / 1e6
        print(
            f"{case.name:>11} {case.query_len:>5} {case.seq_len:>7} {kernel_ms:10.3f} "
            f"{torch_ms:9.3f} {kernel_gf:11.1f} {torch_gf:10.1f} {torch_ms / kernel_ms:6.2f}x"
        )
        rows.append(
            {
                "case": case.name,
                "new_tokens": case.query_len,
                "context": case.seq_len,
                "heads": f"{case.num_heads}/{case.num_kv_heads}x{case.head_dim}",
                "kernel_ms": kernel_ms,
                "torch_ms": torch_ms,
                "kernel_gflop_per_s": kernel_gf,
                "torch_gflop_per_s": torch_gf,
                "speedup": torch_ms / kernel_ms,
            }
        )
    step = {backend: _prefill_step_ms(backend, args.repeats) for backend in ("cpu", "torch")}
    print(
        f"demo prefill step, 256 tokens: cpu backend {step['cpu']:.2f} ms, "
        f"torch backend {step['torch']:.2f} ms"
    )
    payload = {
        "benchmark": "cpu_prefill_attention",
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "block_size": BLOCK_SIZE,
        "results": rows,
        "prefill_step_256_ms": step,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
