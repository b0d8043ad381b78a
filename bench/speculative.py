"""Speculative decoding (ngram prompt lookup) against the same engine without it, same run.

    .venv/bin/python -m bench.speculative [--model engine/demo_model/assets] [--device cpu]
        [--batch-sizes 1,8,32] [--output-len 128] [--num-speculative-tokens 2,4]
        [--prompt-lookup-min 1] [--prompt-lookup-max 3] [--disable-by-batch-size N]
        [--repeats 3] [--threads 1]

Two workloads of greedy requests (``ignore_eos``, ``--output-len`` tokens each):
- ``docstrings``: the first 24 tokens of docstrings from the demo model's own corpus (Python's
  standard library), which the model continues in its own repetitive style: where prompt
  lookup helps;
- ``random``: prompts of random token ids, whose continuations rarely repeat: what proposing,
  computing and checking drafts that fall costs.
For each batch size, each engine (drafts off, then each ``--num-speculative-tokens``) runs the
same requests ``--repeats`` times, alternating; the median wall time gives output tokens/s.
Each engine's outputs are compared with the baseline's (greedy must not change). Prints a
table and writes JSON with the acceptance rate, the steps, and (on CUDA) how many of them
replayed a CUDA graph ("graphed"; steps with drafts replay them too).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.results_json import write_json
from bench.vllm_side import vllm_rows
from engine import LLM, SamplingParams
from engine.demo_model.corpus import corpus_documents

DEMO_MODEL = Path(__file__).resolve().parents[1] / "engine" / "demo_model" / "assets"
PROMPT_LEN = 24


def docstring_prompts(llm: LLM, count: int, seed: int) -> list[list[int]]:
    assert llm.tokenizer is not None
    documents = [d for d in corpus_documents() if len(d) > 200]
    chosen = random.Random(seed).sample(documents, count)
    return [llm.tokenizer.encode(doc)[:PROMPT_LEN] for doc in chosen]


def random_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(count)]


def make_engine(args: argparse.Namespace, num_speculative_tokens: int) -> LLM:
    speculative = None
    if num_speculative_tokens > 0:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
            "disable_by_batch_size": args.disable_by_batch_size,
        }
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=False,  # every repeat computes its prompts
        speculative_config=speculative,
    )


def timed_run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    stats = llm.engine.stats
    before = (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_draft_tokens)
    replays_before = _num_graph_replays(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "num_steps": stats.num_steps - before[0],
        "num_draft_tokens": stats.num_draft_tokens - before[1],
        "num_accepted_draft_tokens": stats.num_accepted_draft_tokens - before[2],
        # steps replayed from CUDA graphs (on CUDA; with drafts too): the rest ran eagerly
        "num_graph_replays": _num_graph_replays(llm) - replays_before,
    }


def _num_graph_replays(llm: LLM) -> int:
    graphs = llm.engine.runner.decode_graphs
    return 0 if graphs is None else sum(graphs.num_replays.values())


def run_case(
    engines: dict[Any, LLM],
    prompts: list[list[int]],
    args: argparse.Namespace,
    baseline: Any = 0,
) -> tuple[dict[Any, dict[str, Any]], list[list[int]]]:
    """Each engine's runs of ``prompts`` (``args.repeats``, alternating), against the
    ``baseline`` engine's tokens (by its key: 0 drafts here), and those tokens."""
    for llm in engines.values():  # warm-up: the same shapes, other prompts' order
        llm.generate(prompts[::-1], SamplingParams(temperature=0.0, max_tokens=8))
    runs: dict[Any, list[dict[str, Any]]] = {k: [] for k in engines}
    for _ in range(args.repeats):
        for k, llm in engines.items():
            runs[k].append(timed_run(llm, prompts, args.output_len))
    baseline_tokens = runs[baseline][0]["tokens"]
    results = {}
    num_output = len(prompts) * args.output_len
    for k, k_runs in runs.items():
        # greedy must not change; on a GPU a near-tie may still flip between a drafting
        # engine's steps (folded verify rows) and the baseline's: counted, not hidden
        num_differing = sum(
            tokens != expected
            for run in k_runs
            for tokens, expected in zip(run["tokens"], baseline_tokens, strict=True)
        )
        if num_differing:
            print(f"warning: {num_differing} outputs of {k!r} differ from the baseline's")
        seconds = statistics.median(run["seconds"] for run in k_runs)
        last = k_runs[-1]
        drafts = last["num_draft_tokens"]
        results[k] = {
            "median_seconds": seconds,
            "output_tokens_per_s": num_output / seconds,
            "num_steps": last["num_steps"],
            "num_graph_replays": last["num_graph_replays"],
            "num_draft_tokens": drafts,
            "acceptance_rate": last["num_accepted_draft_tokens"] / drafts if drafts else None,
            "num_outputs_differing_from_baseline": num_differing,
        }
    return results, baseline_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", default="2,4")
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [0, *(int(k) for k in args.num_speculative_tokens.split(","))]
    engines = {k: make_engine(args, k) for k in ks}
    baseline = engines[0]
    vocab_size = baseline.engine.model_config.vocab_size
    rows = []
    print(
        f"{'workload':<11} {'batch':>5} {'drafts':>6} {'tok/s':>9} {'speed-up':>8} "
        f"{'steps':>6} {'graphed':>7} {'accepted':>8}"
    )
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        workloads = {
            "docstrings": docstring_prompts(baseline, batch_size, args.seed + batch_size),
            "random": random_prompts(vocab_size, batch_size, args.seed + batch_size),
        }
        for workload, prompts in workloads.items():
            results, _ = run_case(engines, prompts, args)
            base_rate = results[0]["output_tokens_per_s"]
            for k, result in results.items():
                result.update(
                    workload=workload,
                    batch_size=batch_size,
                    num_speculative_tokens=k,
                    speed_up=result["output_tokens_per_s"] / base_rate,
                )
                rows.append(result)
                rate = result["acceptance_rate"]
                print(
                    f"{workload:<11} {batch_size:>5} {k:>6} {result['output_tokens_per_s']:>9.0f} "
                    f"{result['speed_up']:>7.2f}x {result['num_steps']:>6} "
                    f"{result['num_graph_replays']:>7} {'-' if rate is None else f'{rate:.0%}':>8}"
                )
    path = write_json(args.out, {"args": vars(args), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()


NAME_WIDTH = 14  # of a drafting bench's table's drafts column ("vllm perturbed")


def add_drafting_args(
    parser: argparse.ArgumentParser, num_speculative_tokens: int, out: str
) -> None:
    """The options the drafting benches (bench.draft_model, bench.mtp) share."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=num_speculative_tokens)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None, help="vLLM side by side (CPU)")
    parser.add_argument("--out", default=out)


def drafting_rows(
    engines: dict[str, LLM], batches: list[list[list[int]]], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[list[list[int]]]]:
    """Each engine's row at each batch of prompts (``run_case`` against the one named "none",
    with its speed-up over it), printed as a table's lines; and the baseline's tokens per
    batch."""
    rows, baselines = [], []
    width = NAME_WIDTH
    print(
        f"{'batch':>5} {'drafts':>{width}} {'tok/s':>9} {'speed-up':>8} {'steps':>6} {'stood':>8}"
    )
    for prompts in batches:
        results, baseline_tokens = run_case(engines, prompts, args, baseline="none")
        baselines.append(baseline_tokens)
        base_rate = results["none"]["output_tokens_per_s"]
        for name, result in results.items():
            result.update(
                engine="pdserve",
                batch_size=len(prompts),
                drafts=name,
                speed_up=result["output_tokens_per_s"] / base_rate,
            )
            rows.append(result)
            rate = result["acceptance_rate"]
            print(
                f"{len(prompts):>5} {name:>{width}} {result['output_tokens_per_s']:>9.0f} "
                f"{result['speed_up']:>7.2f}x {result['num_steps']:>6} "
                f"{'-' if rate is None else f'{rate:.0%}':>8}"
            )
    return rows, baselines


def drafting_report(
    engines: dict[str, LLM],
    batches: list[list[list[int]]],
    args: argparse.Namespace,
    vllm_runs: Callable[[], dict[str, list[dict[str, Any]]]],
) -> dict[str, Any]:
    """A drafting bench's report, written to ``args.out``: each engine's rows
    (``drafting_rows``), then with ``args.vllm_python`` vLLM's (``vllm_runs()``: its runs by
    drafts' name, "none" first; ``bench.vllm_side.vllm_rows``)."""
    rows, baselines = drafting_rows(engines, batches, args)
    if args.vllm_python:
        rows += vllm_rows(vllm_runs(), batches, baselines, args.output_len)
    report = {"args": vars(args), "results": rows}
    print(f"wrote {write_json(args.out, report)}")
    return report
