"""The engine's host time per decode step: scheduling, inputs, sampling and bookkeeping.

    .venv/bin/python -m bench.engine_overhead [--device cpu] [--batch-sizes 1,8,64,256]
        [--context-len 1000]

A one-layer Llama of hidden size 64 (dummy weights) makes the model's share of a step small,
so what is left is what the engine itself costs around the model: on a GPU that time is not
hidden behind the forward, and an 8B model's batch-256 step is ~15 ms at the roofline. For
each batch size, that many prompts of ``--context-len`` random tokens are prefilled, then 40
decode steps are timed: the step's wall time, the time spent inside the model's calls
(``forward`` and ``compute_logits``, wrapped), and the difference, the host time. The same
steps run with the prefix cache on (the default) and off in the same run: its bookkeeping must
cost a step what the step filled, not the sequences' lengths. Writes JSON.

On cuda (bf16) the decode steps replay CUDA graphs, whose forward the wrapper does not see:
there the host time includes the one-layer model's GPU time (tens of microseconds), an upper
bound on what the engine costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu.shapes import MODELS
from bench.results_json import write_json

NUM_WARMUP_STEPS = 5
NUM_TIMED_STEPS = 40
SPEC = replace(MODELS["tiny"], num_layers=1)


class ModelClock:
    """Seconds spent inside the model's calls since the last ``reset``."""

    def __init__(self, model: Any) -> None:
        self.seconds = 0.0
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def build_engine(
    model_dir: Path, device: str, max_batch: int, context_len: int, prefix: bool
) -> Any:
    from engine import LLM

    max_len = context_len + NUM_WARMUP_STEPS + NUM_TIMED_STEPS + 64
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        dtype="float32" if device == "cpu" else "bfloat16",
        device=device,
        skip_tokenizer_init=True,
        num_kv_blocks=max_batch * (-(-max_len // 16)) + 64,
        max_model_len=max_len,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(8192, context_len + 1),
        enable_prefix_caching=prefix,
    )
    return llm.engine


def measure(engine: Any, clock: ModelClock, batch_size: int, context_len: int) -> dict[str, Any]:
    from engine import SamplingParams

    rng = random.Random(batch_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_WARMUP_STEPS + NUM_TIMED_STEPS + 32, ignore_eos=True
    )
    request_ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
    for request_id in request_ids:
        prompt = [rng.randrange(3, SPEC.vocab_size - 2) for _ in range(context_len)]
        engine.add_request(request_id, prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        engine.step()
    for _ in range(NUM_WARMUP_STEPS):
        engine.step()
    steps, model = [], []
    for _ in range(NUM_TIMED_STEPS):
        clock.seconds = 0.0
        started = time.perf_counter()
        result = engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        steps.append(time.perf_counter() - started)
        model.append(clock.seconds)
        if len(result.new_tokens) != batch_size:
            raise RuntimeError(f"step was not a pure batch-{batch_size} decode")
    for request_id in request_ids:
        engine.abort_request(request_id)
    step_ms, model_ms = statistics.median(steps) * 1e3, statistics.median(model) * 1e3
    return {
        "batch_size": batch_size,
        "step_ms": step_ms,
        "model_ms": model_ms,
        "host_ms": step_ms - model_ms,
        "host_us_per_seq": (step_ms - model_ms) * 1e3 / batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--context-len", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench/results/engine_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = SPEC.write_config(Path(tmp), args.context_len + 1024, "float32")
        for prefix in (True, False):
            label = "prefix_cache_on" if prefix else "prefix_cache_off"
            engine = build_engine(
                model_dir, args.device, max(batch_sizes), args.context_len, prefix
            )
            clock = ModelClock(engine.runner.model)
            results[label] = []
            for batch_size in batch_sizes:
                row = measure(engine, clock, batch_size, args.context_len)
                results[label].append(row)
                print(
                    f"{label:>16} batch {batch_size:>3}: step {row['step_ms']:6.2f} ms, "
                    f"model {row['model_ms']:6.2f} ms, host {row['host_ms']:5.2f} ms "
                    f"({row['host_us_per_seq']:.1f} us/seq)",
                    flush=True,
                )
    payload = {
        "benchmark": "engine_overhead",
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device,
        "context_len": args.context_len,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
