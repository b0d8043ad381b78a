"""Priority scheduling against first-come-first-served, same engine, same requests, same run.

    .venv/bin/python -m bench.priority [--num-requests 96] [--urgent-share 0.25]
        [--max-num-seqs 8] [--output-len 32] [--rate 0 | --rate R]

A burst of greedy requests (the bundled demo model, float32, one torch thread) more than the
engine runs at once (``--max-num-seqs``), every ``1 / --urgent-share``-th of them asking for
priority -1 and the rest 0; with ``--rate R`` they arrive as a Poisson stream of R req/s
instead of all at once. Each policy runs the same requests twice, alternating; a request's
time to first token is from its arrival to the step that gave its first token. Prints each
class's TTFT percentiles and the run's output tokens/s per policy, checks that every output
is the same under both (the order changes when, never what), and writes JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_json import write_json
from bench.serving.metrics import latency_stats
from engine import LLM, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parents[1] / "engine" / "demo_model" / "assets"
PROMPT_LEN = 32


def run(
    llm: LLM, prompts: list[list[int]], priorities: list[int], arrivals: list[float], args: Any
) -> dict[str, Any]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ttft: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    arrived_at: dict[str, float] = {}
    pending = list(range(len(prompts)))
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - started
        while pending and arrivals[pending[0]] <= now:
            index = pending.pop(0)
            request_id = str(index)
            engine.add_request(request_id, prompts[index], params, priority=priorities[index])
            arrived_at[request_id] = now
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        step = engine.step()
        now = time.perf_counter() - started
        for event in step.new_tokens:
            if event.position == 0:
                ttft[event.request_id] = now - arrived_at[event.request_id]
        for finished in step.finished:
            outputs[finished.request_id] = list(finished.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    return {"ttft": ttft, "outputs": outputs, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.priority")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--urgent-share", type=float, default=0.25)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.0, help="req/s; 0: all at once")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/priority.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    every = max(1, round(1 / args.urgent_share))
    priorities = [-1 if i % every == every - 1 else 0 for i in range(args.num_requests)]
    arrivals = [0.0] * args.num_requests
    if args.rate > 0:
        clock = 0.0
        for i in range(args.num_requests):
            clock += rng.expovariate(args.rate)
            arrivals[i] = clock
    engines = {
        policy: LLM(
            str(DEMO_MODEL),
            dtype="float32",
            device="cpu",
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,
            scheduling_policy=policy,
        )
        for policy in ("fcfs", "priority")
    }
    vocab = engines["fcfs"].engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in arrivals]
    fcfs_priorities = [0] * args.num_requests  # fcfs takes only 0; the classes are the same
    runs: dict[str, list[dict[str, Any]]] = {"fcfs": [], "priority": []}
    for _ in range(args.repeats):
        runs["fcfs"].append(run(engines["fcfs"], prompts, fcfs_priorities, arrivals, args))
        runs["priority"].append(run(engines["priority"], prompts, priorities, arrivals, args))
    expected = runs["fcfs"][0]["outputs"]
    rows = []
    print(f"{'policy':>9}{'class':>8}{'p50 TTFT ms':>13}{'p90':>9}{'p99':>9}{'tok/s':>9}")
    for policy, policy_runs in runs.items():
        for result in policy_runs:
            if result["outputs"] != expected:
                raise SystemExit(f"{policy}: outputs differ from fcfs's")
        tokens_per_s = statistics.median(
            args.num_requests * args.output_len / r["seconds"] for r in policy_runs
        )
        for name, wanted in (("urgent", -1), ("normal", 0)):
            ttfts = [
                r["ttft"][str(i)]
                for r in policy_runs
                for i, p in enumerate(priorities)
                if p == wanted
            ]
            stats = latency_stats(ttfts, (50.0, 90.0, 99.0))
            row = {"policy": policy, "class": name, "tokens_per_s": tokens_per_s}
            row.update({f"{key}_ms": value for key, value in stats.percentiles_ms.items()})
            rows.append(row)
            print(
                f"{policy:>9}{name:>8}{row['p50_ms']:>13.0f}{row['p90_ms']:>9.0f}"
                f"{row['p99_ms']:>9.0f}{tokens_per_s:>9.0f}"
            )
    result = {"benchmark": "priority", "args": vars(args), "rows": rows}
    print(f"-> {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
