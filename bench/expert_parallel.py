"""Expert parallelism on this CPU: a mixture-of-experts model on two ranks, its experts split
by columns (every rank a half of every expert) against dealt out whole (each rank four whole
experts of eight, ``enable_expert_parallel``), in the same run.

    .venv/bin/python -m bench.expert_parallel [--rounds 2] [--out bench/results/expert_parallel.json]

A dummy-weight Mixtral (hidden 1024, 4 layers, 16 heads of head_dim 64 with 8 KV heads, 8
experts of intermediate 1408, 2 per token, vocab 32000) makes the experts most of a step's
weights. Each round builds ``LLM(tensor_parallel_size=2)`` both ways, the order reversing from
round to round, and measures what bench/tensor_parallel.py measures (offline throughput of a
batch, the median prefill step of P tokens and decode step of B sequences, rank 0's time in
collectives), and besides:
  - the experts' weight bytes rank 0 holds (the projections packed for oneDNN where they are);
  - the share of the batch's (token, expert) pairs rank 0's experts took: under expert
    parallelism each rank computes its own experts' pairs only, so a step waits at the MoE
    block's all-reduce for the rank whose experts the router picked more;
  - greedy outputs: expert parallelism adds the experts' shares in another order, so its tokens
    may differ from the column split's only at a near-tie (top-2 logit gap < 1e-3, measured on
    one rank) at the first divergence; any other difference fails the run after its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_json import write_json
from bench.tensor_parallel import (
    CollectiveClock,
    OtherProcessesClock,
    Workload,
    build_llm,
    compare_greedy,
    greedy,
    machine,
    parse_workload_args,
    print_greedy_check,
    time_decode_steps,
    time_prefill_steps,
    time_throughput,
)
from engine import LLM
from engine.kernels.linear import PackedLinear

VOCAB_SIZE = 32000
EP_BENCH: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
# a check of the script at small sizes (tests/bench/test_expert_parallel_bench.py)
TINY = {
    **EP_BENCH,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
CONFIGS = {"ep-bench": EP_BENCH, "tiny": TINY}
LAYOUTS = {False: "TP 2, experts by columns", True: "TP 2, experts whole (EP)"}


def expert_bytes(llm: LLM) -> int:
    """The routed experts' weight bytes rank 0 holds: their parameters, and the projections
    packed for oneDNN (the stacked parameters are given up once packed)."""
    model = llm.engine.model
    params = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name
    )
    packed = sum(
        m.packed_weight.numel() * m.packed_weight.element_size()
        for name, m in model.named_modules()
        if ".experts." in name and isinstance(m, PackedLinear)
    )
    return params + packed


def rank0_pair_share(llm: LLM, before: tuple[int, ...]) -> float:
    """The share of the pairs since ``before`` (per-expert totals) that experts 0-3 took: rank
    0's under expert parallelism."""
    counts = llm.engine.runner.expert_tokens
    assert counts is not None
    taken = [now - then for now, then in zip(counts.per_expert(), before, strict=True)]
    return sum(taken[: len(taken) // 2]) / max(1, sum(taken))


def run_layout(
    model_dir: Path, expert_parallel: bool, args: argparse.Namespace, workload: Workload
) -> dict[str, Any]:
    """Builds the LLM one way, measures it, and closes it."""
    torch.set_num_threads(args.threads)
    llm = build_llm(model_dir, 2, args, enable_expert_parallel=expert_parallel)
    try:
        assert llm.engine.group is not None
        clock = CollectiveClock(llm.engine.group)
        llm.generate(workload.warmup, greedy(4))
        counts = llm.engine.runner.expert_tokens
        assert counts is not None
        before = counts.per_expert()
        throughput, token_ids = time_throughput(llm, clock, workload.batch, workload.output_len)
        share = rank0_pair_share(llm, before)
        return {
            "config": LAYOUTS[expert_parallel],
            "expert_parallel": expert_parallel,
            "threads_per_rank": torch.get_num_threads(),
            "rank0_expert_bytes": expert_bytes(llm),
            "rank0_pair_share_in_batch": share,
            "throughput": throughput,
            "prefill_step": time_prefill_steps(llm, clock, workload.prefill),
            "decode_step": time_decode_steps(llm, clock, workload.decode, args.num_steps),
            "token_ids": token_ids,
        }
    finally:
        llm.close()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each layout's means over the rounds, and expert parallelism's over the column split's."""
    metrics = {
        "output_tokens_per_second": lambda r: r["throughput"]["output_tokens_per_second"],
        "prefill_step_ms": lambda r: r["prefill_step"]["median_ms"],
        "decode_step_ms": lambda r: r["decode_step"]["median_ms"],
        "decode_collectives_ms": lambda r: r["decode_step"]["collectives"]["median_ms"],
        "rank0_expert_bytes": lambda r: r["rank0_expert_bytes"],
    }
    means = {
        layout: {
            name: statistics.mean(value(r) for r in runs if r["config"] == layout)
            for name, value in metrics.items()
        }
        for layout in LAYOUTS.values()
    }
    columns, whole = means[LAYOUTS[False]], means[LAYOUTS[True]]
    return {
        "mean_by_config": means,
        "ep_over_columns": {name: whole[name] / columns[name] for name in metrics},
    }


def table(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"| round | layout | output tok/s | prefill {args.prefill_tokens} tok ms "
        f"| decode batch {args.decode_batch} ms | collectives in decode step ms "
        "| rank 0's experts MB | rank 0's pairs | others' CPU |",
        "|" + "---|" * 9,
    ]
    for run in runs:
        decode = run["decode_step"]
        lines.append(
            f"| {run['round']} | {run['config']} "
            f"| {run['throughput']['output_tokens_per_second']:.1f} "
            f"| {run['prefill_step']['median_ms']:.1f} | {decode['median_ms']:.1f} "
            f"| {decode['collectives']['median_ms']:.1f} "
            f"| {run['rank0_expert_bytes'] / 1e6:.1f} | {run['rank0_pair_share_in_batch']:.0%} "
            f"| {run['other_processes_cpu_share']:.0%} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="ep-bench")
    parser.add_argument("--rounds", type=int, default=2, help="each runs both layouts")
    return parse_workload_args(parser, argv, "bench/results/expert_parallel.json")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = Workload.of(args, VOCAB_SIZE)
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(CONFIGS[args.model]))
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for expert_parallel in order:
                started, others = time.perf_counter(), OtherProcessesClock()
                run = run_layout(model_dir, expert_parallel, args, workload)
                run["wall_seconds"] = time.perf_counter() - started
                run["other_processes_cpu_share"] = others.share()
                runs.append({"round": round_index, **run})
                print(f"round {round_index}, {run['config']}: {run['wall_seconds']:.1f} s")
        torch.set_num_threads(args.threads)
        greedy_check = compare_greedy(model_dir, args, workload.batch, runs)
    print(table(runs, args))
    summary = summarize(runs)
    ratios = summary["ep_over_columns"]
    print(
        f"experts whole / by columns (means over {args.rounds} rounds): throughput "
        f"{ratios['output_tokens_per_second']:.2f}x, prefill step {ratios['prefill_step_ms']:.2f}x, "
        f"decode step {ratios['decode_step_ms']:.2f}x, rank 0's expert bytes "
        f"{ratios['rank0_expert_bytes']:.2f}x"
    )
    print_greedy_check(greedy_check)
    payload = {
        "benchmark": "expert_parallel",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(load_before),
        "model": CONFIGS[args.model],
        "workload": {k: v for k, v in vars(args).items() if k not in ("out", "model")},
        "runs": [{k: v for k, v in run.items() if k != "token_ids"} for run in runs],
        "summary": summary,
        "greedy": greedy_check,
    }
    print(f"-> {write_json(args.out, payload)}")
    if not greedy_check["passed"]:
        raise SystemExit("greedy outputs of the two layouts differ beyond near-ties")


if __name__ == "__main__":
    main()
