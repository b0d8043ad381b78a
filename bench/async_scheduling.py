"""Decode steps back to back with async scheduling against stepping in turn, in the same run.

    .venv/bin/python -m bench.async_scheduling [--device cpu] [--model tiny]
        [--batch-sizes 1,8,64] [--context-len 256] [--steps 40]
    python -m bench.async_scheduling --device cuda --model 1b --batch-sizes 1,64,256 \\
        --context-len 1000      # on a GPU (bf16, CUDA graphs)

For each mode the same engine is built (dummy weights from the model's shapes, bench/gpu/
shapes.py), ``batch`` prompts of ``--context-len`` tokens are prefilled, then ``--steps``
decode steps run back to back, as a server runs them: the device is synchronised before the
first and after the last only, so the time is what a step costs in steady state. In turn, a
step is the host's work (scheduling, inputs, sampling's setup, bookkeeping) plus the device's
forward; with async scheduling the host's work for the next step runs while the device
computes this one (engine/llm_engine.py), so a step costs about the larger of the two.

On a CPU the forward runs on the host, synchronously: there is nothing to overlap, and the two
modes should cost the same (the check that async scheduling adds no host work of its own).
Writes JSON.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.shapes import MODELS, random_prompt
from bench.gpu.timing import free_memory, synchronize
from bench.results_json import write_json

NUM_WARMUP_STEPS = 5
MODES = ("in_turn", "async")


def build_llm(
    model_dir: Path, device: str, max_batch: int, max_len: int, async_scheduling: bool
) -> Any:
    from engine import LLM

    return LLM(
        str(model_dir),
        load_format="dummy",
        dtype="float32" if device == "cpu" else "bfloat16",
        device=device,
        skip_tokenizer_init=True,
        num_kv_blocks=max_batch * (-(-max_len // 16)) + 64,
        max_model_len=max_len,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(8192, max_len),
        async_scheduling=async_scheduling,
    )


def measure(
    engine: Any, batch_size: int, context_len: int, num_steps: int, vocab_size: int
) -> dict[str, Any]:
    from engine import SamplingParams

    rng = random.Random(batch_size)
    max_tokens = NUM_WARMUP_STEPS + num_steps + 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
    for request_id in request_ids:
        engine.add_request(request_id, random_prompt(rng, context_len, vocab_size), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        engine.step()
    for _ in range(NUM_WARMUP_STEPS):
        engine.step()
    device = engine.device
    synchronize(device)
    started = time.perf_counter()
    num_tokens = 0
    for _ in range(num_steps):
        num_tokens += len(engine.step().new_tokens)
    synchronize(device)
    seconds = time.perf_counter() - started
    if num_tokens != batch_size * num_steps:
        raise RuntimeError(f"the steps were not batch-{batch_size} decodes ({num_tokens} tokens)")
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():  # the step launched ahead, of aborted requests
        engine.step()
    return {
        "batch_size": batch_size,
        "step_ms": seconds / num_steps * 1e3,
        "tokens_per_s": num_tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench/results/async_scheduling.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.context_len + NUM_WARMUP_STEPS + args.steps + 16
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        model_dir = spec.write_config(Path(tmp), max_len + 64, dtype)
        for mode in MODES:
            llm = build_llm(model_dir, args.device, max(batch_sizes), max_len, mode == "async")
            results[mode] = []
            for batch_size in batch_sizes:
                row = measure(llm.engine, batch_size, args.context_len, args.steps, spec.vocab_size)
                results[mode].append(row)
                print(
                    f"{mode:>8} batch {batch_size:>3}: {row['step_ms']:7.2f} ms/step, "
                    f"{row['tokens_per_s']:9.0f} tokens/s",
                    flush=True,
                )
            del llm
            free_memory(torch.device(args.device))
    print("\n| batch | in turn: ms/step | async: ms/step | async speed-up |\n|---|---|---|---|")
    for in_turn, ahead in zip(results["in_turn"], results["async"], strict=True):
        speedup = in_turn["step_ms"] / ahead["step_ms"]
        print(
            f"| {in_turn['batch_size']} | {in_turn['step_ms']:.2f} | {ahead['step_ms']:.2f} "
            f"| {speedup:.2f}x |"
        )
    payload = {
        "benchmark": "async_scheduling",
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": args.model,
        "context_len": args.context_len,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
