"""A quantized KV cache on this machine: bytes per token, the sequences a decode worker holds at
one memory budget, the demo model's held-out perplexity and the engine's offline throughput,
for each ``kv_cache_dtype`` against the float32 cache, all in one run.

    .venv/bin/python -m bench.quantized_kv_cache [--budget-mib 64] [--seq-len 1024]
        [--num-prompts 32] [--out bench/results/quantized_kv_cache.json]

The bundled demo model (float32 weights) runs with a float32, a bfloat16 (the model in bf16:
a cache stores the model's dtype), an fp8_e4m3 and an int8 cache. For each:
- KV bytes per token (every layer's K and V) and the blocks a cache of ``--budget-mib`` holds,
  hence the sequences of ``--seq-len`` tokens a decode worker holds at that budget;
- perplexity over the demo model's held-out docstrings (engine/demo_model/train.py's
  held-out windows), from the engine's prompt logprobs;
- offline tokens per second on one workload (prompts of 32-256 tokens asking for 64 tokens,
  ignore_eos), against the float32 cache's.
The same bytes and sequences for Llama-3-8B's shape (32 layers, 8 KV heads of 128) are
computed from its layout, not measured.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.kv_transfer import machine_info
from engine import LLM, SamplingParams
from engine.demo_model import DEMO_MODEL_DIR
from engine.demo_model.held_out import held_out_perplexity, held_out_windows
from engine.kv_cache.budget import KVLayout
from engine.kv_cache.kv_quantization import storage_dtype

BLOCK_SIZE = 16
# (model dtype, kv_cache_dtype) per row; float32 is the baseline
ROWS: dict[str, tuple[str, str]] = {
    "float32": ("float32", "auto"),
    "bfloat16": ("bfloat16", "auto"),
    "fp8_e4m3": ("float32", "fp8_e4m3"),
    "int8": ("float32", "int8"),
}
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}


def throughput(llm: LLM, num_prompts: int, vocab_size: int) -> float:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 256))]
        for _ in range(num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def computed_llama3_8b(budget_bytes: int, seq_len: int) -> dict[str, dict[str, float]]:
    rows = {}
    for name, (dtype, kv_cache_dtype) in ROWS.items():
        layout = KVLayout(
            block_size=BLOCK_SIZE,
            dtype=storage_dtype(kv_cache_dtype, getattr(torch, dtype)),
            **LLAMA3_8B,
        )
        blocks = budget_bytes // layout.bytes_per_block
        rows[name] = {
            "kv_bytes_per_token": layout.bytes_per_block / BLOCK_SIZE,
            "sequences_held": blocks // -(-seq_len // BLOCK_SIZE),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--llama3-budget-gib", type=int, default=40)
    parser.add_argument("--out", default="bench/results/quantized_kv_cache.json")
    args = parser.parse_args()
    budget = args.budget_mib << 20
    windows = held_out_windows()
    rows: dict[str, dict[str, Any]] = {}
    for name, (dtype, kv_cache_dtype) in ROWS.items():
        llm = LLM(
            str(DEMO_MODEL_DIR),
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_bytes=budget,
            block_size=BLOCK_SIZE,
        )
        cache = llm.engine.kv_cache
        num_blocks = int(cache.shape[2])
        block_bytes = cache.numel() // num_blocks * cache.element_size()
        rows[name] = {
            "model_dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "kv_bytes_per_token": block_bytes / BLOCK_SIZE,
            "num_blocks": num_blocks,
            "sequences_held": num_blocks // -(-args.seq_len // BLOCK_SIZE),
            "held_out_perplexity": held_out_perplexity(llm, windows),
            "tokens_per_s": throughput(llm, args.num_prompts, llm.engine.model_config.vocab_size),
        }
        print(name, {k: v for k, v in rows[name].items() if k != "model_dtype"}, flush=True)
    base = rows["float32"]
    for row in rows.values():
        row["bytes_vs_float32"] = row["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        row["sequences_vs_float32"] = row["sequences_held"] / base["sequences_held"]
        row["perplexity_vs_float32"] = row["held_out_perplexity"] / base["held_out_perplexity"]
        row["throughput_vs_float32"] = row["tokens_per_s"] / base["tokens_per_s"]
    result = {
        "benchmark": "quantized_kv_cache",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "config": {
            "model": "pdserve-demo",
            "budget_mib": args.budget_mib,
            "seq_len": args.seq_len,
            "num_prompts": args.num_prompts,
            "held_out_tokens": sum(len(w) - 1 for w in windows),
        },
        "rows": rows,
        "llama3_8b_computed": {
            "budget_gib": args.llama3_budget_gib,
            "rows": computed_llama3_8b(args.llama3_budget_gib << 30, args.seq_len),
        },
    }
    print(f"\n{'cache':9} {'B/token':>8} {'seqs':>6} {'ppl':>8} {'tok/s':>8} {'x f32':>6}")
    for name, row in rows.items():
        print(
            f"{name:9} {row['kv_bytes_per_token']:8.0f} {row['sequences_held']:6d} "
            f"{row['held_out_perplexity']:8.3f} {row['tokens_per_s']:8.1f} "
            f"{row['throughput_vs_float32']:6.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
