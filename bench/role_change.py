"""A worker's change of role in place against starting a worker of the new role, same run.

    .venv/bin/python -m bench.role_change [--model DIR | --model-size medium] [--device cpu]
        [--rounds 3] [--num-kv-blocks 512] [--tensor-parallel-size 1]

What ``--rebalance`` saves by keeping a switching worker's weights (router/worker_host.py:
``WorkerHost.change_role``). Each round, in one process and without Ray:
  in place  -- a decode worker becomes a prefill worker, then a decode worker again: the old
               worker stops, its KV cache is freed, the new role's engine and KV cache are
               built on the weights in memory;
  new       -- the old worker stops, and a worker of the new role is built in this process
               from the model's files;
  new process -- a worker of the new role is built in a process of its own, from its start
               (Python, torch, the worker's modules) to its worker ready: what a switch did
               before (the old process stopped, a new actor loaded the model; Ray's own
               scheduling of the actor is not counted).
After every change to decode, one greedy request runs on the new worker and its tokens are
checked against the first decode worker's. Prints the median seconds per change and writes
JSON with every time. With ``--tensor-parallel-size`` N > 1 each worker has N ranks, its
followers in processes of their own (engine/parallel/ranks.py, as the offline ``LLM`` starts
them): in place they rebuild with rank 0 on the shards they hold; a new worker, or a new
process, starts new followers, which load their shards from the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from bench.serving.tiny_model import MODEL_SIZES, add_model_args, build_tiny_llama
from engine import GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kv_cache.budget import KVBudget
from engine.parallel.group import free_port
from engine.parallel.ranks import FollowerProcesses
from engine.scheduler import SchedulerConfig
from kv_transfer.policy import TransferConfig
from router.worker_host import WorkerHost, WorkerSpec

GATEWAY = "bench"
ROLES = ("prefill", "decode")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.role_change",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(parser, "medium")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="per worker")
    parser.add_argument("--transport", default="shm", help="KV transport (pdserve's on one host)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per worker")
    parser.add_argument("--out", type=Path, default=Path("bench/results/role_change"))
    parser.add_argument("--build-one", choices=ROLES, help=argparse.SUPPRESS)  # (a child's)
    return parser


def _spec(args: argparse.Namespace, model_dir: str, role: str, worker_id: str) -> WorkerSpec:
    parallel = None  # one rank; else a group of its own, on a port of its own
    if args.tensor_parallel_size > 1:
        parallel = ParallelConfig(args.tensor_parallel_size, port=free_port("127.0.0.1"))
    return WorkerSpec(
        role,
        worker_id,
        LoadConfig(model_dir, dtype=args.dtype, device=args.device),
        CacheConfig(block_size=16, budget=KVBudget(num_blocks=args.num_kv_blocks)),
        SchedulerConfig(max_num_batched_tokens=512),
        TransferConfig(transport=args.transport, host="127.0.0.1"),
        parallel,
    )


class _Worker:
    """A worker built from the model's files: its host (rank 0, in this process) and, with
    several ranks, its followers' processes."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.followers = None
        if spec.parallel is not None:
            configs = (spec.load, spec.cache, spec.scheduler, spec.speculative)
            self.followers = FollowerProcesses.start(*configs, spec.parallel)
        try:
            self.host = WorkerHost(spec)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop rank 0 (its engine tells its followers to stop), then reap the followers."""
        if hasattr(self, "host"):
            self.host.shutdown()
        if self.followers is not None:
            self.followers.stop()


def _greedy(host: WorkerHost, request_id: str) -> list[int]:
    """One greedy request's tokens on the host's decode worker."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    host.submit(GenerateRequest(request_id, list(range(5, 37)), params, GATEWAY))
    tokens: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        batch = host.worker.next_batch(GATEWAY, 0.1)
        for event in () if batch is None else batch.events:
            tokens.append(event.token_id)
            if event.finish_reason is not None:
                return tokens
    raise RuntimeError(f"{request_id} did not finish in 300 s")


def _new_process_seconds(args: argparse.Namespace, model_dir: str, role: str) -> float:
    """From starting a process to its worker of ``role`` ready (then it is stopped)."""
    argv = [
        sys.executable, "-m", "bench.role_change", "--build-one", role, "--model", model_dir,
        "--device", args.device, "--dtype", args.dtype,
        "--num-kv-blocks", str(args.num_kv_blocks), "--transport", args.transport,
        "--tensor-parallel-size", str(args.tensor_parallel_size),
    ]  # fmt: skip
    began = time.perf_counter()
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        seconds = time.perf_counter() - began
        child.stdin.close()  # its cue to stop
        if line.strip() != "ready":
            raise RuntimeError(f"the {role} worker's process did not start: {line!r}")
        # its start is what is timed; a failed exit is said, not taken for a failed start (once
        # in CI the child aborted at interpreter exit after a clean shutdown: "terminate called
        # without an active exception", a native thread's teardown, not diagnosed)
        status = child.wait(timeout=120)
        if status != 0:
            print(f"warning: the {role} worker's process exited with {status} after its start",
                  file=sys.stderr)  # fmt: skip
    return seconds


def _build_one(args: argparse.Namespace) -> int:
    """(In the child process of ``_new_process_seconds``.)"""
    worker = _Worker(_spec(args, args.model, args.build_one, f"{args.build_one}-new"))
    print("ready", flush=True)
    sys.stdin.read()
    worker.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.build_one:
        return _build_one(args)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be >= 1")
    resize = MODEL_SIZES[args.model_size]
    model_dir = args.model or str(build_tiny_llama(args.out / "model", None, resize))
    times: dict[str, dict[str, list[float]]] = {
        way: {role: [] for role in ROLES} for way in ("in_place", "new", "new_process")
    }
    parts: list[dict[str, Any]] = []  # each change in place's own account of its parts
    worker = _Worker(_spec(args, model_dir, "decode", "decode-0"))
    host = worker.host
    expected = _greedy(host, "warm")
    serial = 0
    try:
        for _ in range(args.rounds):
            for role in ("prefill", "decode"):  # in place: decode -> prefill -> decode
                serial += 1
                began = time.perf_counter()
                change = host.change_role(_spec(args, model_dir, role, f"{role}-{serial}"))
                times["in_place"][role].append(time.perf_counter() - began)
                parts.append({"to_role": role, **dataclasses.asdict(change)})
                if role == "decode" and _greedy(host, f"r{serial}") != expected:
                    raise AssertionError("a worker that changed role decoded other tokens")
            for role in ("prefill", "decode"):  # new: stop it, build one from the files
                serial += 1
                began = time.perf_counter()
                worker.shutdown()
                worker = _Worker(_spec(args, model_dir, role, f"{role}-{serial}"))
                host = worker.host
                times["new"][role].append(time.perf_counter() - began)
                if role == "decode" and _greedy(host, f"r{serial}") != expected:
                    raise AssertionError("a new decode worker decoded other tokens")
            for role in ROLES:
                times["new_process"][role].append(_new_process_seconds(args, model_dir, role))
    finally:
        worker.shutdown()
    medians = {
        way: {role: statistics.median(values) for role, values in by_role.items()}
        for way, by_role in times.items()
    }
    print(f"{'to role':8} {'in place s':>10} {'new s':>8} {'new process s':>14}")
    for role in ROLES:
        print(
            f"{role:8} {medians['in_place'][role]:10.3f} {medians['new'][role]:8.3f} "
            f"{medians['new_process'][role]:14.3f}"
        )
    payload: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "model": model_dir,
        "device": args.device,
        "dtype": args.dtype,
        "num_kv_blocks": args.num_kv_blocks,
        "tensor_parallel_size": args.tensor_parallel_size,
        "seconds": times,
        "median_seconds": medians,
        "in_place_parts": parts,
    }
    print(f"wrote {write_json(args.out / 'role_change.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
