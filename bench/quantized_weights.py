"""Quantized checkpoints on this machine: weight bytes against bfloat16, and the engine's offline
throughput on CPU against the float32 model, all formats in one run.

    .venv/bin/python -m bench.quantized_weights [--num-prompts 32] [--out bench/results/x.json]

A random Llama (hidden 512, 4 layers, 8 heads of 64, 4 KV heads, intermediate 1536, vocab
8192) is saved with transformers, then quantized by compressed-tensors (W4A16 with groups of
128, W8A16 per channel, W8A8 int8 and FP8_DYNAMIC with per-token inputs) and written in the
block-wise FP8 layout (blocks of 128), as the tests make them (tests/fixtures/quantized_
models.py). For each: the bytes of the decoder's projections and of the whole model as the
engine holds them, against the same model in bfloat16; and the engine's tokens per second,
float32 activations, on one workload (prompts of 32-256 tokens asking for 16-64 tokens,
ignore_eos), against the float32 model's. The KV cache is the model dtype's in every format
(weights only are quantized), so its bytes per token do not change here.

On CPU each quantized projection dequantizes its weight when it runs: the point there is
correctness and memory; speed is the GPU kernels' (not measured without a GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from tests.fixtures.quantized_models import (
    make_fp8_block_model,
    make_pack_quantized_model,
    make_w8a8_model,
)

SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 8192,
    "max_position_embeddings": 1024,
    "initializer_range": 0.02,
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def build(root: Path) -> dict[str, Path]:
    """Each format's checkpoint, and the float model they were made from."""
    dirs = {
        "w4a16-g128": make_pack_quantized_model(
            root / "w4", num_bits=4, group_size=128, symmetric=True, **SHAPE
        ),
        "w8a16-channel": make_pack_quantized_model(
            root / "w8", num_bits=8, group_size=None, symmetric=True, **SHAPE
        ),
        "w8a8-int8": make_w8a8_model(root / "int8", kind="int", **SHAPE),
        "fp8-dynamic": make_w8a8_model(root / "fp8", kind="float", **SHAPE),
        "fp8-block": make_fp8_block_model(root / "fp8b", **SHAPE),
    }
    return {"float": dirs["w4a16-g128"].parent / "float", **dirs}


def held_bytes(model_dir: Path) -> tuple[int, int]:
    """Bytes of the projections and of the whole model as the engine holds it (bfloat16 for
    what the checkpoint does not quantize)."""
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        device="cpu",
        skip_tokenizer_init=True,
        linear_backend="torch",
        num_kv_blocks=16,
    )
    named = list(llm.engine.model.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in named)
    projections = sum(
        p.numel() * p.element_size() for name, p in named if name.split(".")[-2] in PROJECTIONS
    )
    return projections, total


def throughput(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> float:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:4], params[:4])  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == sum(lengths)
    return sum(lengths) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench/results/quantized_weights.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = SHAPE["vocab_size"]
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))]
        for _ in range(args.num_prompts)
    ]
    lengths = [rng.randint(16, 64) for _ in range(args.num_prompts)]
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir in build(Path(tmp)).items():
            projections, total = held_bytes(model_dir)
            rows[name] = {
                "projection_bytes": projections,
                "model_bytes": total,
                "tokens_per_second": throughput(model_dir, prompts, lengths),
            }
            print(f"{name}: {rows[name]}", flush=True)
    base = rows["float"]
    for row in rows.values():
        row["projection_bytes_vs_bf16"] = row["projection_bytes"] / base["projection_bytes"]
        row["model_bytes_vs_bf16"] = row["model_bytes"] / base["model_bytes"]
        row["throughput_vs_float32"] = row["tokens_per_second"] / base["tokens_per_second"]
    print(
        f"\n{'format':14} {'proj MiB':>9} {'vs bf16':>8} {'model MiB':>10} {'vs bf16':>8} "
        f"{'tok/s':>8} {'vs fp32':>8}"
    )
    for name, row in rows.items():
        print(
            f"{name:14} {row['projection_bytes'] / 2**20:9.2f} "
            f"{row['projection_bytes_vs_bf16']:7.3f}x {row['model_bytes'] / 2**20:10.2f} "
            f"{row['model_bytes_vs_bf16']:7.3f}x {row['tokens_per_second']:8.1f} "
            f"{row['throughput_vs_float32']:7.3f}x"
        )
    result = {
        "benchmark": "quantized_weights",
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "shape": SHAPE,
        "workload": {
            "num_prompts": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(lengths),
        },
        "formats": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
