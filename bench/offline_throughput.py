"""Offline throughput: this engine against transformers ``generate`` on the same weights.

    .venv/bin/python -m bench.offline_throughput [--num-prompts 64]
        [--model dense|moe|mla|gpt_oss]
        [--out bench/results/x.json]

A random Llama (hidden 256, 4 layers, head_dim 64, vocab 8192) is saved with transformers and
loaded by both systems; ``--model moe``: a random Mixtral of the same width and depth, each
layer's MLP 8 experts of the Llama's MLP width, 2 per token; ``--model mla``: a random
DeepSeek-V3 of the same width and depth (latent attention: 4 heads of 64 + 32 rope dims over a
latent of 128; a dense first layer, then 8 routed experts of a quarter of that width, 2 per
token from the best 2 of 4 groups, and a shared one); ``--model gpt_oss``: a random gpt-oss of
the same width and depth (attention sinks, sliding windows of 128 on every other layer, 8
clamped-SwiGLU experts of the Llama's MLP width, 2 per token). 64 prompts of 32-512 tokens
ask for 16-256 tokens each (ignore_eos).
The baseline is transformers ``generate`` with static, left-padded batches (each batch decodes
until its longest request is done); both count only the tokens the requests asked for.
Also reported: this engine's per-step overhead (time outside the model forward) as a fraction
of step time, overall and over decode-only steps of 64 sequences.
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
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from engine import LLM, LLMEngine, SamplingParams


def build_model(
    out_dir: Path, vocab_size: int, kind: str = "dense", resize: dict[str, int] | None = None
) -> Path:
    """``resize``: config keys to change (hidden_size, num_hidden_layers ...)."""
    shape = {
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    shape.update(resize or {})
    torch.manual_seed(0)
    if kind == "moe":
        moe = MixtralConfig(**shape, num_local_experts=8, num_experts_per_tok=2)
        MixtralForCausalLM(moe).save_pretrained(str(out_dir))
    elif kind == "mla":
        mla = DeepseekV3Config(
            **{**shape, "head_dim": 32},  # transformers' name for the rope dims
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=172,
            first_k_dense_replace=1,
        )
        DeepseekV3ForCausalLM(mla).save_pretrained(str(out_dir))
    elif kind == "gpt_oss":
        gpt_oss = GptOssConfig(
            **shape, num_local_experts=8, num_experts_per_tok=2, sliding_window=128
        )
        GptOssForCausalLM(gpt_oss).save_pretrained(str(out_dir))
    else:
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(str(out_dir))
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


def run_engine(
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    warmup: tuple[list[list[int]], list[int]],
) -> dict:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        skip_tokenizer_init=True,
    )
    # Warm up on a different workload of the same shape (no prefix-cache hits carry over), so
    # the timed run sees the steady state of a long-running server: buffers already grown.
    llm.generate(warmup[0], _greedy(warmup[1]))
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, _greedy(output_lens))):
        engine.add_request(f"bench-{i}", prompt, p)
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        num_seqs = _pure_decode_batch(engine)
        before = (engine.stats.step_seconds, engine.stats.forward_seconds)
        result = engine.step()
        step_seconds = engine.stats.step_seconds - before[0]
        forward_seconds = engine.stats.forward_seconds - before[1]
        steps.append((num_seqs, step_seconds, forward_seconds, len(result.new_tokens)))
    seconds = time.perf_counter() - started
    num_tokens = sum(s[3] for s in steps)
    assert num_tokens == sum(output_lens), (num_tokens, sum(output_lens))
    big = [s for s in steps if s[0] >= 64]  # decode-only steps of 64 sequences
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
        "prefix_cache_hits": engine.block_manager.pool.num_cache_hits,
    }


def _pure_decode_batch(engine: LLMEngine) -> int:
    """Sequences the next step decodes, or 0 if it also holds prompt work."""
    scheduler = engine.scheduler
    if scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        return 0
    return len(scheduler.running)


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _greedy(output_lens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]


def run_transformers(
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    batch_size: int,
    warmup: tuple[list[list[int]], list[int]],
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

    warm_prompts, warm_lens = warmup
    generate(warm_prompts[:batch_size], max(warm_lens[:batch_size]))  # warm-up: one full batch
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
    parser.add_argument("--model", choices=["dense", "moe", "mla", "gpt_oss"], default="dense")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench/results/offline_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts, output_lens = make_workload(args.num_prompts, args.vocab_size, seed=0)
    warmup = make_workload(args.num_prompts, args.vocab_size, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args.vocab_size, args.model)
        ours = run_engine(model_dir, prompts, output_lens, warmup)
        print(
            f"pdserve engine: {ours['tokens_per_second']:.1f} tok/s; overhead "
            f"{ours['overhead_fraction']:.1%} (batch>=64: {ours['overhead_fraction_batch_ge_64']})"
        )
        baselines = []
        for batch_size in args.hf_batch_sizes:
            hf = run_transformers(model_dir, prompts, output_lens, batch_size, warmup)
            baselines.append(hf)
            print(
                f"transformers generate (batch {batch_size}): {hf['tokens_per_second']:.1f} tok/s"
            )
    best = max(baselines, key=lambda b: b["tokens_per_second"])
    result = {
        "benchmark": "offline_throughput",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": _cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "workload": {
            "num_prompts": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(output_lens),
            "vocab_size": args.vocab_size,
            "model": args.model,
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
