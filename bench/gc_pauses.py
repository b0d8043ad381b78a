"""The garbage collector's pauses in a serving cluster, with the start-up heap frozen
(``engine/startup_heap.py``, what pdserve does) against not, same load, same run.

    .venv/bin/python -m bench.gc_pauses [--prefill 1 --decode 1] [--rate 15]
        [--num-prompts 1500] [--min-pause-ms 10]

Each server is ``pdserve serve`` on a tiny random Llama (``bench/serving/tiny_model.py``)
with a ``sitecustomize`` on its PYTHONPATH, which every process of it imports (the gateway,
the workers, Ray's daemons): it times each collection with ``gc.callbacks`` and appends those
of at least ``--min-pause-ms`` to a file per process. For the baseline it also makes
``gc.freeze`` do nothing, so the server runs as before the freeze. Each server gets the same
Poisson arrivals (prompts uniform in 128-1024 tokens, outputs in 16-64), after two warm-up
requests; the pauses counted are those between the first request sent and the last answered.
Prints, per configuration and kind of process (gateway, worker), the pauses of the oldest
generation (their number, total and longest) and the client's TTFT and inter-token latency
p50 / p99 / max; writes one JSON with every pause and every record.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO
from bench.serving.report import result_dict
from bench.serving.runner import BenchConfig, BenchResult, run_benchmark
from bench.serving.servers import RunningServer, ServerSpec, cores_per_worker, pdserve_server
from bench.serving.tiny_model import build_tiny_llama
from bench.serving.workloads import WorkloadSpec

SERVED_NAME = "pdserve-demo"
MODEL_POSITIONS = 2048
CONFIGS = ("not frozen", "frozen")  # the baseline first

# imported by every Python process of the server (its PYTHONPATH leads with this file's folder)
SITECUSTOMIZE = """
import gc, os, sys, time

_LOG_DIR = os.environ["PDSERVE_GC_LOG_DIR"]
_MIN_S = float(os.environ["PDSERVE_GC_MIN_PAUSE_S"])
if os.environ.get("PDSERVE_GC_NO_FREEZE") == "1":
    gc.freeze = lambda: None  # the baseline: as before pdserve froze its start-up heap
_started = [0.0]
_log = []


def _timed(phase, info):
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    seconds = time.perf_counter() - _started[0]
    if seconds < _MIN_S:
        return
    if not _log:
        _log.append(open(os.path.join(_LOG_DIR, f"{os.getpid()}.log"), "a", buffering=1))
    command = " ".join(sys.argv)[:200].replace("\\t", " ")
    _log[0].write(f"{time.time():.6f}\\t{info['generation']}\\t{seconds:.6f}\\t{command}\\n")


gc.callbacks.append(_timed)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gc_pauses",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--rate", type=float, default=15.0, help="requests per second")
    parser.add_argument("--num-prompts", type=int, default=1500)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker")
    parser.add_argument("--min-pause-ms", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gc_pauses"))
    parser.add_argument("--no-progress", action="store_true")
    return parser


def process_kind(command: str) -> str:
    """The kind of server process a collection ran in, from its command line."""
    if "router.cli" in command or "router/cli.py" in command:  # (``-m``: the module's path)
        return "gateway"
    if "default_worker" in command:
        return "worker"
    return "ray daemon"


def read_pauses(log_dir: Path, since: float, until: float) -> list[dict[str, Any]]:
    """The collections logged between ``since`` and ``until`` (wall clock), every process."""
    pauses = []
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text().splitlines():
            at, generation, seconds, command = line.split("\t", 3)
            if since <= float(at) <= until:
                pauses.append(
                    {
                        "at": float(at),
                        "generation": int(generation),
                        "seconds": float(seconds),
                        "pid": int(path.stem),
                        "kind": process_kind(command),
                    }
                )
    return pauses


def summary_rows(config: str, pauses: list[dict[str, Any]], result: BenchResult) -> list[str]:
    """The table's rows of one configuration: each kind of process's oldest-generation
    pauses, beside the client's latencies."""
    ok = [r for r in result.records if r.success]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    itl = sorted(gap for r in ok for gap in r.itl_s)
    client = f"{_spread(ttft)} {_spread(itl)}"
    rows = []
    for kind in ("gateway", "worker"):
        oldest = [p["seconds"] for p in pauses if p["kind"] == kind and p["generation"] == 2]
        total, longest = sum(oldest), max(oldest, default=0.0)
        rows.append(
            f"{config:11} {kind:8} {len(oldest):6d} {total * 1000:9.0f} {longest * 1000:8.0f}  "
            + client
        )
    return rows


def _spread(ordered: list[float]) -> str:
    """p50/p99/max of sorted seconds, in ms."""
    if not ordered:
        return "-"
    at = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99)]
    return "/".join(f"{s * 1000:.0f}" for s in (*at, ordered[-1]))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = str(build_tiny_llama(args.out / "model", MODEL_POSITIONS))
    workload = WorkloadSpec(kind="uniform", input_range=(128, 1024), output_range=(16, 64))
    cores = cores_per_worker(args.prefill + args.decode)
    rows = [
        f"{'config':11} {'process':8} {'pauses':>6} {'total ms':>9} {'max ms':>8}  "
        "client TTFT p50/p99/max, ITL p50/p99/max (ms)"
    ]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-gc-") as scratch:
        (Path(scratch) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for config in CONFIGS:
            log_dir = args.out / config.replace(" ", "_")
            log_dir.mkdir(parents=True, exist_ok=True)
            for old in log_dir.glob("*.log"):
                old.unlink()
            spec = _server(args, model_dir, cores, config, scratch, log_dir)
            print(f"== {config}: {' '.join(spec.argv)}", file=sys.stderr)
            with RunningServer(spec, args.out / f"{log_dir.name}.server.log"):
                since = time.time()
                result = run_benchmark(
                    BenchConfig(
                        endpoint=EndpointConfig(spec.base_url, SERVED_NAME, timeout_s=600),
                        tokenizer_dir=model_dir,
                        workload=workload,
                        arrivals=ArrivalSpec(request_rate=args.rate),
                        slo=SLO(None, None),
                        num_prompts=args.num_prompts,
                        seed=args.seed,
                        num_warmups=2,
                        progress=not args.no_progress,
                    )
                )
                until = time.time()
            pauses = read_pauses(log_dir, since, until)
            rows += summary_rows(config, pauses, result)
            runs[config] = {"pauses": pauses, "result": result_dict(result)}
    print("\n".join(rows))
    payload = {"command": " ".join(sys.argv), "rate": args.rate, "runs": runs}
    print(f"wrote {write_json(args.out / 'gc_pauses.json', payload)}")
    return 0


def _server(
    args: argparse.Namespace,
    model_dir: str,
    cores: int,
    config: str,
    scratch: str,
    log_dir: Path,
) -> ServerSpec:
    spec = pdserve_server(
        f"pdserve ({config})", args.prefill, args.decode, args.port, model_dir, SERVED_NAME,
        args.num_kv_blocks, cores_per_worker=cores,
        extra_args=("--max-model-len", str(MODEL_POSITIONS)),
    )  # fmt: skip
    path = f"{scratch}:{Path(__file__).resolve().parents[1]}"
    env = {
        **spec.env,
        "PYTHONPATH": path,
        "PDSERVE_GC_LOG_DIR": str(log_dir.resolve()),
        "PDSERVE_GC_MIN_PAUSE_S": str(args.min_pause_ms / 1000),
        "PDSERVE_GC_NO_FREEZE": "1" if config == "not frozen" else "0",
    }
    return ServerSpec(spec.name, spec.argv, spec.port, spec.health_path, env)


if __name__ == "__main__":
    sys.exit(main())
