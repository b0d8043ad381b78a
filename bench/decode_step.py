"""Engine step times on the bundled demo model: prefill of a batch, then decode-step medians.

    .venv/bin/python -m bench.decode_step [--threads 1] [--batch-sizes 1,4,16,48]

For each batch size, that many prompts of 100-400 random tokens are prefilled (chunked by the
scheduler's token budget) and decoded for 40 tokens each; prints the total prefill time and
the median decode step, for the torch (MKL) and onednn linear backends in the same run, and
writes JSON. Attention is the CPU default in both (C kernels; torch without a compiler).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.results_json import write_json
from engine import LLM, SamplingParams
from engine.demo_model import DEMO_MODEL_DIR


def _measure(llm: LLM, batch_size: int, seed: int) -> dict[str, float]:
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(batch_size):
        prompt = [rng.randrange(100, 4000) for _ in range(rng.randint(100, 400))]
        engine.add_request(f"b{batch_size}-{seed}-{i}", prompt, params)
    prefill_s = 0.0
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        started = time.perf_counter()
        engine.step()
        prefill_s += time.perf_counter() - started
    steps = []
    while engine.scheduler.num_unfinished:
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return {"prefill_ms": prefill_s * 1e3, "decode_step_ms": statistics.median(steps) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,4,16,48")
    parser.add_argument("--out", default="bench/results/decode_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    for backend in ("torch", "onednn"):
        llm = LLM(
            str(DEMO_MODEL_DIR),
            dtype="float32",
            device="cpu",
            num_kv_blocks=4096,
            max_model_len=512,
            linear_backend=backend,
        )
        _measure(llm, 4, seed=99)  # warm-up
        results[backend] = []
        for batch_size in batch_sizes:
            row = {"batch_size": batch_size, **_measure(llm, batch_size, seed=batch_size)}
            results[backend].append(row)
            print(
                f"{backend:>6} batch {batch_size:>3}: prefill {row['prefill_ms']:8.1f} ms, "
                f"decode step {row['decode_step_ms']:6.2f} ms"
            )
    payload = {
        "benchmark": "decode_step",
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
