"""Moving a cached prefix's KV against recomputing it, on this machine's CPU: where they cross.

    .venv/bin/python -m bench.kv_move_vs_recompute [--lengths 16 64 256 1024 4096] [--reps 5]
        [--move-reps 10] [--threads N] [--max-num-batched-tokens 512] [--transports gloo shm]
        [--large-layers 4] [--out bench/results/kv_move_vs_recompute.json]

Two models: the bundled demo model (engine/demo_model/assets) and a Llama of Llama-3.2-1B's
shape (hidden 2048, 32 heads of 64, 8 KV heads, MLP 8192, vocab 128256, tied) cut to
``--large-layers`` layers, dummy weights; both float32, as the other CPU benches run. For each
prefix length a model holds (lengths past its max_model_len are skipped):
- recompute: the engine (LLMEngine on CPU) prefills a prompt of that many random tokens and
  samples one token, wall time from add_request to the step that finishes it, median of
  ``--reps``; every prompt is new, so nothing comes from the prefix cache (checked). The step
  budget is the CPU serve default (router/serve_defaults.py), so a long prompt is chunked as a
  CPU worker chunks it. One untimed prefill of each length up to the step budget first.
- move: the prefix's blocks (ceil(length / block size)) in the engine's cache layout
  (KVCacheLayout.from_cache) sent from this process to a spawned one over each CPU transport,
  opened as bench/kv_transfer.py opens them; ``send_blocks`` end to end (gather + wire +
  scatter), median of ``--move-reps`` rounds after a warm-up round. Beside it, torch ``copy_`` of
  the same bytes (a memcpy, bench/kv_transfer.py's baseline).
- per model and transport: the prefix length below which recomputing is cheaper than moving,
  interpolated between the measured lengths that bracket it, and the per-token costs as the
  router's cost model weighs tokens (docs/kv-routing.md): seconds per token moved over seconds
  per token computed, per length and from affine fits, i.e. a move weight in tokens of compute
  per token moved.
``--threads``: torch's threads in both processes (default: torch's default, one per core).
Both costs grow with the number of layers, so the few-layer model's per-token ratio is close to
its full-depth model's (the one logits row per prompt aside).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from bench.gpu.shapes import MODELS, ModelSpec
from bench.kv_transfer import MIB, TIMEOUT_S, Job, Session, machine_info, memcpy_gbps
from bench.kv_transfer import run_transport as run_channel
from bench.results_json import write_json
from kv_transfer import KVCacheLayout, TransferTicket

BLOCK_SIZE = 16
CPU_STEP_BUDGET = 512  # router/serve_defaults.py STEP_BUDGET["cpu"]
DEMO = "demo"
LARGE = "llama-1b-shape"


# ---- pure parts: the large model's config, the crossover, the fits ---------------------------
def large_model_spec(num_layers: int, vocab_size: int | None = None) -> ModelSpec:
    """Llama-3.2-1B's shape (bench/gpu/shapes.py "1b") with ``num_layers`` layers."""
    base = MODELS["1b"]
    return replace(
        base, name=LARGE, num_layers=num_layers, vocab_size=vocab_size or base.vocab_size
    )


def lengths_held(lengths: list[int], max_model_len: int) -> tuple[list[int], list[int]]:
    """(prefix lengths a model of ``max_model_len`` can prefill and sample after, the rest)."""
    held = [n for n in lengths if n + 1 <= max_model_len]
    return held, [n for n in lengths if n + 1 > max_model_len]


@dataclass(frozen=True, slots=True)
class Crossover:
    """Where recomputing a prefix stops being cheaper than moving its KV, from measured points."""

    kind: Literal["move_always", "recompute_always", "crossover"]
    recompute_cheaper_up_to: int | None  # longest measured length where recomputing was cheaper
    move_cheaper_from: int | None  # the measured length after it (moving cheaper there)
    estimate_tokens: float | None  # where the two costs meet, linearly interpolated between them
    non_monotonic: bool  # moving was cheaper at some length below recompute_cheaper_up_to

    def statement(self) -> str:
        if self.kind == "move_always":
            return "moving is cheaper at every measured length"
        if self.kind == "recompute_always":
            return "recomputing is cheaper at every measured length"
        note = " (not monotonic: moving also won below it)" if self.non_monotonic else ""
        return (
            f"recomputing is cheaper below ~{self.estimate_tokens:.0f} tokens (measured: "
            f"cheaper at {self.recompute_cheaper_up_to}, moving cheaper at "
            f"{self.move_cheaper_from}){note}"
        )


def find_crossover(lengths: list[int], recompute_s: list[float], move_s: list[float]) -> Crossover:
    """The crossover of two cost curves measured at the same increasing ``lengths``."""
    if not len(lengths) == len(recompute_s) == len(move_s) or not lengths:
        raise ValueError("need one recompute and one move time per length, and a length")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths must increase, got {lengths}")
    cheaper = [r < m for r, m in zip(recompute_s, move_s)]
    if not any(cheaper):
        return Crossover("move_always", None, None, None, False)
    last = max(i for i, c in enumerate(cheaper) if c)
    non_monotonic = not all(cheaper[: last + 1])
    if last == len(lengths) - 1:
        return Crossover("recompute_always", lengths[last], None, None, non_monotonic)
    # move - recompute is > 0 at `last` and <= 0 at `last + 1`: where the line between is 0
    gap_before = move_s[last] - recompute_s[last]
    gap_after = move_s[last + 1] - recompute_s[last + 1]
    fraction = gap_before / (gap_before - gap_after)
    estimate = lengths[last] + fraction * (lengths[last + 1] - lengths[last])
    return Crossover("crossover", lengths[last], lengths[last + 1], estimate, non_monotonic)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points; needs two xs."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("need as many ys as xs, and two distinct xs")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    slope /= sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def move_weights(
    lengths: list[int], recompute_s: list[float], move_s: list[float]
) -> dict[str, Any]:
    """The router's form: a token moved costs ``weight`` tokens computed, per length and fitted.

    The fits are affine (fixed + per-token): ``fixed_tokens`` is the move's fixed cost in
    tokens of compute, ``weight`` the ratio of the slopes."""
    per_length = [m / r for r, m in zip(recompute_s, move_s)]
    result: dict[str, Any] = {"per_length": dict(zip(map(str, lengths), per_length))}
    if len(set(lengths)) >= 2:
        compute_fixed, compute_slope = fit_line([float(n) for n in lengths], recompute_s)
        move_fixed, move_slope = fit_line([float(n) for n in lengths], move_s)
        result["fit"] = {
            "compute_fixed_s": compute_fixed,
            "compute_s_per_token": compute_slope,
            "move_fixed_s": move_fixed,
            "move_s_per_token": move_slope,
            "weight": move_slope / compute_slope,
            "fixed_tokens": move_fixed / compute_slope,
        }
    return result


# ---- recompute: the engine's prefill --------------------------------------------------------
def build_engine(model_dir: Path, dummy: bool, max_len: int, step_budget: int) -> Any:
    from engine import LLMEngine
    from engine.engine_config import CacheConfig, LoadConfig
    from engine.kv_cache.budget import KVBudget
    from engine.scheduler import SchedulerConfig

    return LLMEngine(
        LoadConfig(
            str(model_dir), "float32", "cpu", "dummy" if dummy else "auto", max_model_len=max_len
        ),
        CacheConfig(BLOCK_SIZE, True, KVBudget(num_blocks=-(-max_len // BLOCK_SIZE) + 4)),
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=step_budget),
    )


def time_prefill(engine: Any, num_tokens: int, request_id: str, seed: int) -> float:
    """Seconds to prefill a new prompt of ``num_tokens`` random tokens and sample one token."""
    from engine import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(3, engine.model_config.vocab_size - 2) for _ in range(num_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    computed_before = engine.stats.num_prefill_tokens
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - started
    if engine.stats.num_prefill_tokens - computed_before != num_tokens:
        raise RuntimeError(f"{request_id}: not every prompt token was computed (a cache hit?)")
    return seconds


def measure_recompute(
    engine: Any, name: str, lengths: list[int], reps: int, step_budget: int
) -> dict[int, list[float]]:
    """Per length, the prefill times of ``reps`` new prompts, taken in rounds over every length
    after untimed warm-ups (each length up to the step budget: longer ones are such chunks)."""
    for n in lengths:
        if n <= step_budget:
            time_prefill(engine, n, f"{name}-warmup-{n}", seed=-n)
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(reps):
        for n in lengths:
            samples[n].append(time_prefill(engine, n, f"{name}-{n}-{rep}", n * 1000 + rep))
    for n in lengths:
        median_ms = statistics.median(samples[n]) * 1e3
        print(f"  {name} recompute {n:>5} tokens: {median_ms:9.2f} ms", flush=True)
    return samples


# ---- move: the prefix's blocks between two processes ------------------------------------------
def move_session(
    name: str, layout: KVCacheLayout, num_blocks: list[int], reps: int, seed: int
) -> Session:
    """One channel of ``layout``: a warm-up round that moves each block count once, then
    ``reps`` timed rounds, each over every count (so the channel's start slows no one count)."""
    num_cache_blocks = 2 * max(num_blocks) + 8
    rng = random.Random(seed)
    jobs: list[Job] = []
    for rep in range(reps + 1):
        for count in num_blocks:
            ticket = TransferTicket(len(jobs), f"{name}-{count}-{rep}", count, TIMEOUT_S)
            jobs.append(
                Job(
                    "warmup" if rep == 0 else "timed",
                    count * layout.block_nbytes / MIB,
                    ticket,
                    rng.sample(range(num_cache_blocks), count),
                    rng.sample(range(num_cache_blocks), count),
                )
            )
    return Session(name, layout, num_cache_blocks, jobs)


def move_times(session: Session, pairs: list[tuple[Any, Any]]) -> dict[int, dict[str, Any]]:
    """Per block count: the sender's end-to-end median, its samples and phases, in seconds."""
    rows: dict[int, dict[str, Any]] = {}
    for count in sorted({job.ticket.num_blocks for job in session.jobs}):
        timed = [
            (sent, received)
            for job, (sent, received) in zip(session.jobs, pairs)
            if job.ticket.num_blocks == count and job.label == "timed"
        ]
        rows[count] = {
            "seconds": statistics.median(s.total_s for s, _ in timed),
            "min_s": min(s.total_s for s, _ in timed),
            "samples_s": [s.total_s for s, _ in timed],
            "gather_s": statistics.median(s.gather_s for s, _ in timed),
            "scatter_s": statistics.median(r["scatter_s"] for _, r in timed),
            "nbytes": timed[0][0].nbytes,
        }
    return rows


# ---- one run -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelRun:
    """A model's measured lengths, recompute samples and cache layout."""

    name: str
    lengths: list[int]
    skipped: list[int]  # past its max_model_len
    recompute_samples: dict[int, list[float]]
    layout: KVCacheLayout
    kv_bytes_per_token: float


def run_model(
    name: str, model_dir: Path, dummy: bool, args: argparse.Namespace, model_max_len: int
) -> ModelRun | None:
    """The model's recompute samples and cache layout; None when it holds none of the lengths."""
    lengths, skipped = lengths_held(sorted(args.lengths), model_max_len)
    if not lengths:
        print(f"{name}: skipped, every length is past its max_model_len {model_max_len}")
        return None
    engine = build_engine(model_dir, dummy, min(model_max_len, max(lengths) + 1), args.step_budget)
    layout = KVCacheLayout.from_cache(engine.kv_cache)
    samples = measure_recompute(engine, name, lengths, args.reps, args.step_budget)
    return ModelRun(name, lengths, skipped, samples, layout, layout.block_nbytes / BLOCK_SIZE)


def summarize(
    run: ModelRun, moves: dict[str, dict[int, dict[str, Any]]], memcpy_reps: int
) -> dict[str, Any]:
    recompute = [statistics.median(run.recompute_samples[n]) for n in run.lengths]
    rows = []
    for n, recompute_s in zip(run.lengths, recompute):
        num_blocks = -(-n // BLOCK_SIZE)
        nbytes = num_blocks * run.layout.block_nbytes
        row: dict[str, Any] = {
            "tokens": n,
            "num_blocks": num_blocks,
            "nbytes": nbytes,
            "recompute_s": recompute_s,
            "recompute_s_per_token": recompute_s / n,
            "recompute_samples_s": run.recompute_samples[n],
            "memcpy_s": nbytes / (memcpy_gbps(nbytes, "cpu", memcpy_reps) * 1e9),
        }
        for transport, by_blocks in moves.items():
            move = by_blocks[num_blocks]
            row[transport] = {
                **move,
                "s_per_token": move["seconds"] / n,
                "move_over_recompute": move["seconds"] / recompute_s,
            }
        rows.append(row)
    per_transport = {}
    for transport in moves:
        move_s = [row[transport]["seconds"] for row in rows]
        crossover = find_crossover(run.lengths, recompute, move_s)
        per_transport[transport] = {
            "crossover": {**asdict(crossover), "statement": crossover.statement()},
            "move_weight": move_weights(run.lengths, recompute, move_s),
        }
    return {
        "layout": asdict(run.layout),
        "kv_bytes_per_token": run.kv_bytes_per_token,
        "skipped_lengths": run.skipped,
        "rows": rows,
        "transports": per_transport,
    }


def print_tables(models: dict[str, dict[str, Any]], transports: list[str]) -> None:
    head = f"{'model':<15}{'tokens':>7}{'recompute ms':>13}{'us/tok':>10}{'memcpy ms':>10}"
    for transport in transports:
        head += f"{transport + ' ms':>10}{'us/tok':>9}{'move/rec':>9}"
    print("\n" + head)
    for name, model in models.items():
        for row in model["rows"]:
            line = (
                f"{name:<15}{row['tokens']:>7}{row['recompute_s'] * 1e3:>13.2f}"
                f"{row['recompute_s_per_token'] * 1e6:>10.1f}{row['memcpy_s'] * 1e3:>10.3f}"
            )
            for transport in transports:
                move = row[transport]
                line += (
                    f"{move['seconds'] * 1e3:>10.2f}{move['s_per_token'] * 1e6:>9.2f}"
                    f"{move['move_over_recompute']:>9.3f}"
                )
            print(line)
    print()
    for name, model in models.items():
        for transport, data in model["transports"].items():
            fit = data["move_weight"].get("fit")
            weight = (
                ""
                if fit is None
                else (
                    f"; fitted: a token moved costs {fit['weight']:.4f} tokens computed, "
                    f"plus a fixed {fit['fixed_tokens']:.1f} tokens"
                )
            )
            print(f"{name} over {transport}: {data['crossover']['statement']}{weight}")
        if model["skipped_lengths"]:
            print(f"{name}: skipped {model['skipped_lengths']} (past its max_model_len)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=5, help="prefills timed per length")
    parser.add_argument("--move-reps", type=int, default=10, help="moves timed per length")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--step-budget",
        "--max-num-batched-tokens",
        dest="step_budget",
        type=int,
        default=CPU_STEP_BUDGET,
    )
    parser.add_argument("--transports", nargs="+", default=["gloo", "shm"])
    parser.add_argument("--large-layers", type=int, default=4)
    parser.add_argument("--out", default="bench/results/kv_move_vs_recompute.json")
    args = parser.parse_args()
    if min(args.reps, args.move_reps, *args.lengths) < 1 or len(set(args.lengths)) != len(
        args.lengths
    ):
        parser.error("--reps, --move-reps and --lengths must be positive, the lengths distinct")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    from engine.demo_model import DEMO_MODEL_DIR
    from engine.model_config import load_model_config

    spec = large_model_spec(args.large_layers)
    runs: list[ModelRun] = []
    with tempfile.TemporaryDirectory() as tmp:
        large_dir = spec.write_config(Path(tmp), max(args.lengths) + 1, "float32")
        for name, model_dir, dummy in ((DEMO, DEMO_MODEL_DIR, False), (LARGE, large_dir, True)):
            max_len = load_model_config(model_dir).max_position_embeddings
            run = run_model(name, Path(model_dir), dummy, args, max_len)
            runs += [] if run is None else [run]
    moves: dict[str, dict[str, dict[int, dict[str, Any]]]] = {r.name: {} for r in runs}
    sessions = [
        move_session(
            r.name, r.layout, sorted({-(-n // BLOCK_SIZE) for n in r.lengths}), args.move_reps, i
        )
        for i, r in enumerate(runs)
    ]
    for transport in args.transports:
        print(f"moving over {transport} ...", flush=True)
        pairs = run_channel(transport, "cpu", "cpu", sessions, None, args.threads)
        for run, session, session_pairs in zip(runs, sessions, pairs):
            moves[run.name][transport] = move_times(session, session_pairs)
    models = {run.name: summarize(run, moves[run.name], args.move_reps) for run in runs}
    print_tables(models, args.transports)
    payload = {
        "benchmark": "kv_move_vs_recompute",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**machine_info(), "cores": os.cpu_count()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "config": {
            "lengths": sorted(args.lengths),
            "reps": args.reps,
            "move_reps": args.move_reps,
            "step_budget": args.step_budget,
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "large_model": asdict(spec),
        },
        "models": models,
    }
    print(f"\nwrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
