"""Tensor parallelism on this CPU: the same batch on one rank and on two, in the same run.

    .venv/bin/python -m bench.tensor_parallel [--rounds 2] [--out bench/results/tensor_parallel.json]

A dummy-weight Llama (hidden 1024, 4 layers, 16 heads of head_dim 64 with 8 KV heads,
intermediate 2816, vocab 32000: 113M parameters, 451 MB in float32) makes the matmuls most of a
step. Each round builds ``LLM(tensor_parallel_size=1)`` with all cores' torch threads (the
baseline), ``LLM(tensor_parallel_size=2)`` (a rank process per core, a thread each) and, as a
reference for what one core does, ``LLM(tensor_parallel_size=1)`` with one thread; the order
reverses from round to round. On each it measures:
  - offline throughput: one batch of prompts, greedy with ``ignore_eos``, after a warm-up batch
    of another seed (prompts/s and output tokens/s);
  - step latency: the median of several prefill steps of one prompt of P tokens, and of several
    decode steps of a batch of B sequences;
  - at TP 2, the time rank 0 spends inside collectives in each of those steps (and their bytes):
    the model's all-reduces and logits all-gather, and the step mirror's broadcasts of the
    commands and input ids. The bench wraps rank 0's group instance (the engine is unchanged),
    so a collective's time includes rank 0's wait for rank 1 to reach it;
  - greedy outputs: every run's tokens against the first TP 1 run's. The all-reduce sums in
    another order, so a difference is allowed only at a near-tie (top-2 logit gap < 1e-3,
    measured on TP 1) at its first divergence; the near-ties are counted, and any other
    difference makes the bench exit with an error after writing its JSON.
Prints a table and writes JSON, with the share of the CPU that other processes used during
each run: a second thread helps only while the other core is free, and the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu.shapes import MODELS, ModelSpec
from bench.results_json import write_json
from engine import LLM, SamplingParams
from engine.parallel.group import TensorParallelGroup

SPECS = {
    "tp-bench": ModelSpec("tp-bench", 1024, 4, 16, 8, 64, 2816, 32000, tie_word_embeddings=False),
    "tiny": MODELS["tiny"],
}
NEAR_TIE = 1e-3  # top-2 logit gap under which the summation order may pick either token
NUM_WARMUP_STEPS = 2  # untimed decode steps before the timed ones
WARMUP_OUTPUT_LEN = 4  # tokens per prompt of the warm-up batch: its prefills and a few decodes
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")  # broadcast: the step mirror's
WHAT_TWO_CORES_SHOW = (
    "On this 2-core CPU, TP 2 is two rank processes of one core each against one process of "
    "two threads on the same two cores: the arithmetic is the same, split differently, so TP 2 "
    "shows what tensor parallelism costs (the collectives, the step mirror's broadcasts, the "
    "ranks waiting for each other), not a speed-up. On GPUs each rank brings its own device: "
    "TP is what lets a model larger than one device's memory run at all, and what adds "
    "memory bandwidth to a decode step. Two threads in one process meet at a barrier in "
    "every operator, two ranks only at each collective; whenever another process takes a "
    "core, the two-thread baseline loses more than the two ranks do (the one-thread TP 1 row "
    "tells whether the baseline got its second core)."
)


class CollectiveClock:
    """Seconds, calls and bytes of one rank's collectives since the last ``reset``.

    Wraps the group instance's methods (only that instance; the engine's code is unchanged).
    A broadcast of an object counts once, with the bytes of the tensors it broadcasts inside.
    Bytes are the tensor this rank passes in (an all-gather's input, not its result).
    """

    def __init__(self, group: TensorParallelGroup) -> None:
        self._depth = 0  # > 0 inside a wrapped call (broadcast_object calls broadcast)
        self.seconds = dict.fromkeys(COLLECTIVES, 0.0)
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        wrapped: dict[str, Callable[[Any], Any]] = {
            "all_reduce": self._timed("all_reduce", group.all_reduce),
            "all_gather": self._timed("all_gather", group.all_gather),
            "broadcast": self._timed("broadcast", group.broadcast),
            "broadcast_object": self._timed("broadcast", group.broadcast_object),
        }
        for name, method in wrapped.items():
            setattr(group, name, method)

    def reset(self) -> None:
        for kind in COLLECTIVES:
            self.seconds[kind], self.calls[kind], self.bytes[kind] = 0.0, 0, 0

    def snapshot(self) -> dict[str, Any]:
        """The counts since the last reset, and their totals."""
        return {
            "seconds": sum(self.seconds.values()),
            "bytes": sum(self.bytes.values()),
            "by_kind": {
                kind: {
                    "seconds": self.seconds[kind],
                    "calls": self.calls[kind],
                    "bytes": self.bytes[kind],
                }
                for kind in COLLECTIVES
            },
        }

    def _timed(self, kind: str, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def timed(value: Any) -> Any:
            outermost = self._depth == 0
            self._depth += 1
            started = time.perf_counter()
            try:
                return call(value)
            finally:
                self._depth -= 1
                if isinstance(value, torch.Tensor):
                    self.bytes[kind] += value.numel() * value.element_size()
                if outermost:
                    self.seconds[kind] += time.perf_counter() - started
                    self.calls[kind] += 1

        return timed


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Prompts of random tokens (ids 3 .. vocab_size - 3: no bos or eos of the dummy config)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size - 2) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )


def build_llm(model_dir: Path, size: int, args: argparse.Namespace, **options: Any) -> LLM:
    """An LLM of ``size`` ranks over the dummy weights, its KV cache sized to the workload
    (``options``: more of ``LLM``'s arguments)."""
    longest = max(
        args.max_prompt_len + args.output_len,
        args.prefill_tokens + 1,
        args.decode_context + NUM_WARMUP_STEPS + args.num_steps + 8,
    )
    num_tokens = max(args.num_prompts * longest, args.decode_batch * longest)
    return LLM(
        str(model_dir),
        load_format="dummy",
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        max_model_len=longest + 16,
        num_kv_blocks=-(-num_tokens // 16) + 64,
        max_num_seqs=max(args.num_prompts, args.decode_batch),
        max_num_batched_tokens=max(2048, args.prefill_tokens),
        tensor_parallel_size=size,
        **options,
    )


@contextmanager
def collective_step(clock: CollectiveClock | None, into: list[dict[str, Any]]) -> Iterator[None]:
    """Appends the collectives of the enclosed step to ``into`` (nothing at TP 1)."""
    if clock is not None:
        clock.reset()
    yield
    if clock is not None:
        into.append(clock.snapshot())


def time_throughput(
    llm: LLM, clock: CollectiveClock | None, prompts: list[list[int]], output_len: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """The batch's throughput and its greedy tokens, one list per prompt."""
    steps_before = llm.engine.stats.num_steps
    collectives: list[dict[str, Any]] = []
    with collective_step(clock, collectives):
        started = time.perf_counter()
        outputs = llm.generate(prompts, greedy(output_len))
        seconds = time.perf_counter() - started
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    num_tokens = sum(map(len, token_ids))
    if num_tokens != len(prompts) * output_len:
        raise RuntimeError(f"{num_tokens} output tokens, expected {len(prompts) * output_len}")
    result = {
        "seconds": seconds,
        "prompts_per_second": len(prompts) / seconds,
        "output_tokens_per_second": num_tokens / seconds,
        "num_steps": llm.engine.stats.num_steps - steps_before,
        "collectives": collectives[0] if collectives else None,
        "collective_share": collectives[0]["seconds"] / seconds if collectives else None,
    }
    return result, token_ids


def time_prefill_steps(
    llm: LLM, clock: CollectiveClock | None, prompts: list[list[int]]
) -> dict[str, Any]:
    """Each prompt prefilled alone in one step (it asks for one token: the step ends it)."""
    engine = llm.engine
    step_seconds: list[float] = []
    collectives: list[dict[str, Any]] = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{index}", prompt, greedy(1))
        with collective_step(clock, collectives):
            started = time.perf_counter()
            result = engine.step()
            step_seconds.append(time.perf_counter() - started)
        if len(result.finished) != 1:
            raise RuntimeError(f"a prefill step of {len(prompt)} tokens did not end its request")
    return step_summary(step_seconds, collectives, num_tokens=len(prompts[0]))


def time_decode_steps(
    llm: LLM, clock: CollectiveClock | None, prompts: list[list[int]], num_steps: int
) -> dict[str, Any]:
    """``num_steps`` decode steps of the whole batch, after its prefill and a warm-up."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    request_ids = [f"decode-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, greedy(NUM_WARMUP_STEPS + num_steps + 8))
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        engine.step()
    for _ in range(NUM_WARMUP_STEPS):
        engine.step()
    step_seconds: list[float] = []
    collectives: list[dict[str, Any]] = []
    for _ in range(num_steps):
        with collective_step(clock, collectives):
            started = time.perf_counter()
            result = engine.step()
            step_seconds.append(time.perf_counter() - started)
        if len(result.new_tokens) != len(prompts):
            raise RuntimeError(f"a step was not a pure decode of batch {len(prompts)}")
    for request_id in request_ids:
        engine.abort_request(request_id)
    return step_summary(step_seconds, collectives, num_tokens=len(prompts))


def step_summary(
    step_seconds: list[float], collectives: list[dict[str, Any]], num_tokens: int
) -> dict[str, Any]:
    """Median step time, and at TP 2 the median collective time and a step's calls and bytes
    (the same in every step of one shape)."""
    summary: dict[str, Any] = {
        "num_tokens": num_tokens,
        "median_ms": 1e3 * statistics.median(step_seconds),
        "step_ms": [1e3 * s for s in step_seconds],
        "collectives": None,
    }
    if collectives:
        median_ms = 1e3 * statistics.median(c["seconds"] for c in collectives)
        summary["collectives"] = {
            "median_ms": median_ms,
            "share_of_step": median_ms / summary["median_ms"],
            "median_ms_by_kind": {
                kind: 1e3 * statistics.median(c["by_kind"][kind]["seconds"] for c in collectives)
                for kind in COLLECTIVES
            },
            "bytes_per_step": collectives[0]["bytes"],
            "calls_per_step": {k: v["calls"] for k, v in collectives[0]["by_kind"].items()},
            "bytes_by_kind": {k: v["bytes"] for k, v in collectives[0]["by_kind"].items()},
        }
    return summary


@dataclass(frozen=True, slots=True)
class Workload:
    """The prompts every run measures, the same at each size."""

    # a batch like ``batch``, of another seed (no prefix-cache hits), decoded a few tokens
    warmup: list[list[int]]
    batch: list[list[int]]  # the throughput batch
    output_len: int  # tokens each prompt of a batch asks for
    prefill: list[list[int]]  # one prompt of P tokens per timed prefill step
    decode: list[list[int]]  # B prompts of the decode context, decoded together

    @classmethod
    def of(cls, args: argparse.Namespace, vocab_size: int) -> Workload:
        def batch(seed: int) -> list[list[int]]:
            return random_prompts(
                args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size, seed
            )

        return cls(
            warmup=batch(1),
            batch=batch(0),
            output_len=args.output_len,
            prefill=random_prompts(
                args.num_steps, args.prefill_tokens, args.prefill_tokens, vocab_size, 2
            ),
            decode=random_prompts(
                args.decode_batch, args.decode_context, args.decode_context, vocab_size, 3
            ),
        )


def label(size: int, threads_per_rank: int) -> str:
    """A run's name: its ranks, and the torch threads of each."""
    return f"TP {size} x {threads_per_rank} thread{'s' if threads_per_rank > 1 else ''}"


def run_config(
    model_dir: Path, size: int, threads: int, args: argparse.Namespace, workload: Workload
) -> dict:
    """Builds an LLM of ``size`` ranks in a process of ``threads`` torch threads (a rank of
    several takes its share of the cores instead), measures it, and closes it."""
    torch.set_num_threads(threads)
    load_average = os.getloadavg()[0]
    llm = build_llm(model_dir, size, args)
    try:
        clock = CollectiveClock(llm.engine.group) if llm.engine.group is not None else None
        threads_per_rank = torch.get_num_threads()  # rank 0's (every rank holds as many)
        llm.generate(workload.warmup, greedy(WARMUP_OUTPUT_LEN))
        throughput, token_ids = time_throughput(llm, clock, workload.batch, workload.output_len)
        return {
            "config": label(size, threads_per_rank),
            "tensor_parallel_size": size,
            "threads_per_rank": threads_per_rank,
            "load_average_at_start": load_average,
            "throughput": throughput,
            "prefill_step": time_prefill_steps(llm, clock, workload.prefill),
            "decode_step": time_decode_steps(llm, clock, workload.decode, args.num_steps),
            "token_ids": token_ids,
        }
    finally:
        llm.close()


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where ``tokens`` differs from ``reference`` (None: equal)."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))


def compare_greedy(
    model_dir: Path, args: argparse.Namespace, prompts: list[list[int]], runs: list[dict]
) -> dict[str, Any]:
    """Every run's tokens against the first run's (the baseline, round 0); each difference's top-2
    logit gap at its first divergence, measured by a TP 1 LLM built for it (when any)."""
    reference = runs[0]["token_ids"]
    divergences = []
    for run in runs[1:]:
        for index, tokens in enumerate(run["token_ids"]):
            position = first_divergence(tokens, reference[index])
            if position is not None:
                divergences.append(
                    {
                        "round": run["round"],
                        "config": run["config"],
                        "prompt": index,
                        "position": position,
                        "token_ids": sorted({tokens[position], reference[index][position]}),
                    }
                )
    if divergences:
        contexts = [
            prompts[d["prompt"]] + reference[d["prompt"]][: d["position"]] for d in divergences
        ]
        for divergence, (gap, top2) in zip(divergences, top2_gaps(model_dir, args, contexts)):
            divergence["top2_gap"] = gap
            divergence["near_tie"] = gap < NEAR_TIE and sorted(top2) == divergence["token_ids"]
    return {
        "reference": f"round 0, {runs[0]['config']}",
        "num_sequences": len(reference),
        "num_equal": {
            f"round {run['round']}, {run['config']}": sum(
                first_divergence(tokens, ref) is None
                for tokens, ref in zip(run["token_ids"], reference)
            )
            for run in runs
        },
        "divergences": divergences,
        "num_near_ties": sum(d["near_tie"] for d in divergences),
        "passed": all(d["near_tie"] for d in divergences),
    }


def top2_gaps(
    model_dir: Path, args: argparse.Namespace, contexts: list[list[int]]
) -> list[tuple[float, list[int]]]:
    """The top-2 logit gap after each context, and the two token ids, at TP 1."""
    llm = build_llm(model_dir, 1, args)
    try:
        outputs = llm.generate(contexts, greedy(1, logprobs=2))
    finally:
        llm.close()
    gaps = []
    for output in outputs:
        position = (output.outputs[0].logprobs or [{}])[0]
        top2 = sorted(position.items(), key=lambda item: -item[1].logprob)[:2]
        gaps.append((top2[0][1].logprob - top2[1][1].logprob, [token for token, _ in top2]))
    return gaps


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Each configuration's means over the rounds, and TP 2's ratios to the TP 1 runs."""
    metrics: dict[str, Callable[[dict], float]] = {
        "prompts_per_second": lambda r: r["throughput"]["prompts_per_second"],
        "output_tokens_per_second": lambda r: r["throughput"]["output_tokens_per_second"],
        "prefill_step_ms": lambda r: r["prefill_step"]["median_ms"],
        "decode_step_ms": lambda r: r["decode_step"]["median_ms"],
    }
    configs = list(dict.fromkeys(run["config"] for run in runs))  # in run order
    means = {
        config: {
            name: statistics.mean(value(r) for r in runs if r["config"] == config)
            for name, value in metrics.items()
        }
        for config in configs
    }
    tp2 = next(c for c in configs if c.startswith("TP 2"))
    return {
        "mean_by_config": means,
        "tp2_over": {
            config: {name: means[tp2][name] / means[config][name] for name in metrics}
            for config in configs
            if config != tp2
        },
    }


def table(runs: list[dict], args: argparse.Namespace) -> str:
    """One row per run: throughput, step medians, and at TP 2 rank 0's collective time."""

    def collectives(step: dict) -> str:
        c = step["collectives"]
        if c is None:
            return "-"
        return (
            f"{c['median_ms']:.1f} ({c['share_of_step']:.0%}, {c['bytes_per_step'] / 1e6:.2f} MB)"
        )

    def batch_collectives(throughput: dict) -> str:
        c = throughput["collectives"]
        return "-" if c is None else f"{c['seconds']:.1f} s ({throughput['collective_share']:.0%})"

    header = (
        "| round | run | threads/rank | prompts/s | output tok/s "
        f"| prefill {args.prefill_tokens} tok ms | decode batch {args.decode_batch} ms "
        "| collectives in prefill step ms (share, bytes) | in decode step | in the batch "
        "| others' CPU |"
    )
    lines = [header, "|" + "---|" * 11]
    for run in runs:
        t = run["throughput"]
        lines.append(
            f"| {run['round']} | {run['config']} | {run['threads_per_rank']} "
            f"| {t['prompts_per_second']:.2f} | {t['output_tokens_per_second']:.1f} "
            f"| {run['prefill_step']['median_ms']:.1f} | {run['decode_step']['median_ms']:.1f} "
            f"| {collectives(run['prefill_step'])} | {collectives(run['decode_step'])} "
            f"| {batch_collectives(t)} | {run['other_processes_cpu_share']:.0%} |"
        )
    return "\n".join(lines)


class OtherProcessesClock:
    """The share of the machine's CPU time that processes other than this one and its
    children (the follower ranks, once reaped) used since construction (Linux /proc/stat)."""

    def __init__(self) -> None:
        self._started = (time.perf_counter(), _busy_cpu_seconds(), _own_cpu_seconds())

    def share(self) -> float:
        wall, busy, own = self._started
        others = (_busy_cpu_seconds() - busy) - (_own_cpu_seconds() - own)
        return max(0.0, others) / ((time.perf_counter() - wall) * len(os.sched_getaffinity(0)))


def _busy_cpu_seconds() -> float:
    """CPU seconds the machine has been busy since boot: all but idle and iowait."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usages = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(u.ru_utime + u.ru_stime for u in usages)


def print_greedy_check(greedy_check: dict[str, Any]) -> None:
    """``compare_greedy``'s verdict, one line."""
    equal = ", ".join(f"{run} {n}" for run, n in greedy_check["num_equal"].items())
    print(
        f"greedy outputs equal to {greedy_check['reference']}'s, of "
        f"{greedy_check['num_sequences']}: {equal}; "
        f"near-ties at a divergence: {greedy_check['num_near_ties']}"
        + ("" if greedy_check["passed"] else "; A DIFFERENCE IS NOT A NEAR-TIE")
    )


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """The machine a run measured: its CPU and cores, torch, and the load around the run."""
    return {
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (this bench imports no transformers, which
    bench.offline_throughput's helper would pull into every rank process)."""
    with open("/proc/cpuinfo") as cpuinfo:
        names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return names[0] if names else "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="tp-bench")
    parser.add_argument("--rounds", type=int, default=2, help="each runs TP 1 and TP 2")
    return parse_workload_args(parser, argv, "bench/results/tensor_parallel.json")


def parse_workload_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, out: str
) -> argparse.Namespace:
    """``parser``'s arguments with the workload's (``Workload``, the steps timed, the threads)
    and ``--out`` added; ``--rounds`` (the parser's) checked."""
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=256, help="P")
    parser.add_argument("--decode-batch", type=int, default=16, help="B")
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=7, help="timed steps of each kind")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=out)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = SPECS[args.model]
    workload = Workload.of(args, spec.vocab_size)
    load_before = os.getloadavg()
    print(WHAT_TWO_CORES_SHOW, flush=True)
    configs = [(1, args.threads), (2, args.threads)] + ([(1, 1)] if args.threads > 1 else [])
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = spec.write_config(Path(tmp), 8192, "float32")
        for round_index in range(args.rounds):
            for size, threads in configs if round_index % 2 == 0 else configs[::-1]:
                started, others = time.perf_counter(), OtherProcessesClock()
                run = run_config(model_dir, size, threads, args, workload)
                run["wall_seconds"] = time.perf_counter() - started
                run["other_processes_cpu_share"] = others.share()
                runs.append({"round": round_index, **run})
                print(
                    f"round {round_index}, {run['config']}: {run['wall_seconds']:.1f} s; other "
                    f"processes used {run['other_processes_cpu_share']:.0%} of the CPU meanwhile",
                    flush=True,
                )
        torch.set_num_threads(args.threads)
        greedy_check = compare_greedy(model_dir, args, workload.batch, runs)
    print(table(runs, args))
    summary = summarize(runs)
    for config, ratios in summary["tp2_over"].items():
        print(
            f"TP 2 / {config} (means over {args.rounds} rounds): throughput "
            f"{ratios['output_tokens_per_second']:.2f}x, prefill step "
            f"{ratios['prefill_step_ms']:.2f}x, decode step {ratios['decode_step_ms']:.2f}x"
        )
    print_greedy_check(greedy_check)
    payload = {
        "benchmark": "tensor_parallel",
        "date": time.strftime("%Y-%m-%d"),
        "what_two_cores_show": WHAT_TWO_CORES_SHOW,
        "machine": machine(load_before),
        "model": {**asdict(spec), "num_params": spec.num_params, "dtype": "float32"},
        "workload": {k: v for k, v in vars(args).items() if k not in ("out", "model")},
        "runs": [{k: v for k, v in run.items() if k != "token_ids"} for run in runs],
        "summary": summary,
        "greedy": greedy_check,
    }
    print(f"-> {write_json(args.out, payload)}")
    if not greedy_check["passed"]:
        raise SystemExit("greedy outputs of TP 2 differ from TP 1's beyond near-ties")


if __name__ == "__main__":
    main()
