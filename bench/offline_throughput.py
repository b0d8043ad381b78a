"""Offline throughput: this engine against transformers ``generate`` on the same weights.

    .venv/bin/python -m bench.offline_throughput [--num-prompts 64] [--out bench/results/x.json]

A random Llama (hidden 256, 4 layers, head_dim 64, vocab 8192) is saved with transformers and
loaded by both systems. 64 prompts of 32-512 tokens ask for 16-256 tokens each (ignore_eos).
The baseline is transformers ``generate`` with static, left-padded batches (each batch decodes
until its longest request is done); both count only the tokens the requests asked for.
Also reported: this engine's per-step overhead (time outside the model forward) as a fraction
of step time, overall and over steps that ran >= 64 sequences.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine import LLM, SamplingParams


def build_model(out_dir: Path, vocab_size: int) -> Path:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out_dir))
    return out_dir


def make_workload(
    num_prompts: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 512))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(16, 256) for _ in range(num_prompts)]
    return prompts, output_lens


def run_engine(model_dir: Path, prompts: list[list[int]], output_lens: list[int]) -> dict:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        skip_tokenizer_init=True,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:4], params[:4])  # warm-up
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{i}", prompt, p)
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        num_running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        before = (engine.stats.step_seconds, engine.stats.forward_seconds)
        result = engine.step()
        steps.append(
            (
                num_running,
                engine.stats.step_seconds - before[0],
                engine.stats.forward_seconds - before[1],
                len(result.new_tokens),
            )
        )
    seconds = time.perf_counter() - started
    num_tokens = sum(s[3] for s in steps)
    assert num_tokens == sum(output_lens), (num_tokens, sum(output_lens))
    big = [s for s in steps if s[0] >= 64]
    return {
        "seconds": seconds,
        "output_tokens": num_tokens,
        "tokens_per_second": num_tokens / seconds,
        "num_steps": len(steps),
        "overhead_fraction": 1 - sum(s[2] for s in steps) / sum(s[1] for s in steps),
        "overhead_fraction_batch_ge_64": (
            1 - sum(s[2] for s in big) / sum(s[1] for s in big) if big else None
        ),
        "num_steps_batch_ge_64": len(big),
        "mean_step_ms_batch_ge_64": 1000 * sum(s[1] for s in big) / len(big) if big else None,
    }


def run_transformers(
    model_dir: Path, prompts: list[list[int]], output_lens: list[int], batch_size: int
) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def generate(batch: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
            )

    generate(prompts[:2], 4)  # warm-up
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        generate(batch, max(output_lens[start : start + batch_size]))
    seconds = time.perf_counter() - started
    return {
        "batch_size": batch_size,
        "seconds": seconds,
        "tokens_per_second": sum(output_lens) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64, 16])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench/results/offline_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts, output_lens = make_workload(args.num_prompts, args.vocab_size, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args.vocab_size)
        ours = run_engine(model_dir, prompts, output_lens)
        print(
            f"pdserve engine: {ours['tokens_per_second']:.1f} tok/s; overhead "
            f"{ours['overhead_fraction']:.1%} (batch>=64: {ours['overhead_fraction_batch_ge_64']})"
        )
        baselines = []
        for batch_size in args.hf_batch_sizes:
            hf = run_transformers(model_dir, prompts, output_lens, batch_size)
            baselines.append(hf)
            print(
                f"transformers generate (batch {batch_size}): {hf['tokens_per_second']:.1f} tok/s"
            )
    best = max(baselines, key=lambda b: b["tokens_per_second"])
    result = {
        "benchmark": "offline_throughput",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "workload": {
            "num_prompts": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(output_lens),
            "vocab_size": args.vocab_size,
        },
        "pdserve": ours,
        "transformers": baselines,
        "speedup_vs_best_transformers": ours["tokens_per_second"] / best["tokens_per_second"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"speedup vs best transformers batching: {result['speedup_vs_best_transformers']:.2f}x "
        f"-> {out}"
    )


if __name__ == "__main__":
    main()
