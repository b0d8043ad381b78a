"""Prefill steps at a server's fresh token counts: rows padded to buckets against rows as they come.

    .venv/bin/python -m bench.prefill_row_counts [--steps 100] [--rounds 2] [--threads 1]
        [--model DIR] [--out bench/results/prefill_row_counts.json]

oneDNN builds a kernel per row count it is given, and a server's prefill steps come with
ever-new token counts (each prompt's length plus the decodes beside it). So the model runner
pads a step's rows to a few buckets (``engine/kernels/linear.py: padded_rows``). This bench
times the engine's prefill step (one prompt, one thread, prefix caching off) at ``--steps``
prompt lengths drawn without repeats from 192-447 tokens (prompts of 256 +- 64 tokens, and
longer), each length fresh, then the same lengths again, for two variants:

- ``exact``: the runner's padding off (``ModelRunner.pads_rows = False``): every step gives
  oneDNN its own row count, as before the padding;
- ``padded``: the engine as it runs.

Each variant runs in a process of its own (both start with oneDNN's kernel cache empty), in an
order that alternates over ``--rounds``. Prints the median step time per 256 prompt tokens on
fresh and on repeated lengths, and writes JSON. Without ``--model`` the model is
``bench/serving/tiny_model.py``'s (hidden 256, 4 layers, float32: the AIPerf runs' model).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_json import write_json

VARIANTS = ("exact", "padded")
LENGTHS = range(192, 448)
WARMUP_LENGTH = 150  # a length no timed step has


def run_variant(variant: str, model: str, lengths: list[int], threads: int) -> dict[str, Any]:
    """Seconds per prefill step (scaled to 256 tokens) over ``lengths``, fresh then repeated."""
    from engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", device="cpu", enable_prefix_caching=False)
    engine = llm.engine
    engine.runner.pads_rows = variant == "padded"
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    vocab_size = engine.model_config.vocab_size
    request_ids = itertools.count()

    def prefill_seconds(length: int) -> float:
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        engine.add_request(f"r{next(request_ids)}", prompt, params)
        started = time.perf_counter()
        engine.step()  # the prompt's one step: its prefill and first token
        seconds = time.perf_counter() - started
        while engine.has_unfinished_requests():
            engine.step()
        return seconds

    for _ in range(3):
        prefill_seconds(WARMUP_LENGTH)
    times: dict[str, list[float]] = {"fresh": [], "repeated": []}
    for per_256 in times.values():
        for length in lengths:
            per_256.append(prefill_seconds(length) * 256 / length)
    return {"padded_rows": engine.runner.pads_rows, **times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: the tiny Llama of the AIPerf runs")
    parser.add_argument("--out", default="bench/results/prefill_row_counts.json")
    args = parser.parse_args(argv)
    lengths = random.Random(args.seed).sample(list(LENGTHS), min(args.steps, len(LENGTHS)))
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-model-") as scratch:
        model = args.model
        if model is None:
            from bench.serving.tiny_model import build_tiny_llama

            model = str(build_tiny_llama(Path(scratch) / "tiny-llama"))
        runs = _run_rounds(model, lengths, args.rounds, args.threads)
    summary = {
        variant: {
            phase: statistics.median(
                t * 1e3 for run in runs if run["variant"] == variant for t in run[phase]
            )
            for phase in ("fresh", "repeated")
        }
        for variant in VARIANTS
    }
    print(
        f"{len(lengths)} prompt lengths from {LENGTHS.start}-{LENGTHS.stop - 1}, "
        f"{args.rounds} rounds, {args.threads} thread(s): prefill step ms per 256 tokens (median)"
    )
    print(f"{'variant':<8} {'fresh lengths':>14} {'repeated':>9}")
    for variant, phases in summary.items():
        print(f"{variant:<8} {phases['fresh']:>14.2f} {phases['repeated']:>9.2f}")
    for phase in ("fresh", "repeated"):
        ratio = summary["exact"][phase] / summary["padded"][phase]
        print(f"{phase} lengths: padded runs {ratio:.2f}x the speed of exact")
    result = {
        "benchmark": "prefill_row_counts",
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "torch": torch.__version__,
        "lengths": lengths,
        "summary_ms_per_256_tokens": summary,
        "runs": runs,
    }
    print(f"-> {write_json(args.out, result)}")
    return 0


def _run_rounds(model: str, lengths: list[int], rounds: int, threads: int) -> list[dict[str, Any]]:
    """Each variant once per round, each in a fresh process, the order alternating."""
    context = multiprocessing.get_context("spawn")
    runs = []
    for round_index in range(rounds):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            with context.Pool(1) as pool:
                times = pool.apply(run_variant, (variant, model, lengths, threads))
            runs.append({"round": round_index, "variant": variant, **times})
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
