"""How long an idle `pdserve serve` takes to stop: SIGTERM to the last process of its tree gone.

    python -m bench.serve_stop --repeat 5 --baseline-tree /path/to/old/checkout \
        --result-json stop.json -- --model DIR --prefill 2 --decode 2 --worker-num-cpus 0

Each run starts the server from a source tree (this checkout, and the baseline's when given,
in turn so that both see the same load), waits until its process tree has stopped growing,
sends SIGTERM and times until the server's own process has exited and until every process of
its tree is gone. The arguments after ``--`` go to ``pdserve serve`` (``--http-port 0
--grpc-port 0`` are added).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from tests.fixtures.process_tree import TreeProcess, alive, process_tree

_REPO = Path(__file__).resolve().parents[1]
_SETTLED_S = 2.0  # the tree has stopped growing once its processes stayed the same this long
_TIMEOUT_S = 300.0


def stop_once(tree: Path, serve_args: list[str]) -> dict[str, float]:
    """Starts the server from ``tree``, stops it idle; the seconds to its exit and to the tree's."""
    command = [sys.executable, "-m", "router.cli", "serve", *serve_args]
    command += ["--http-port", "0", "--grpc-port", "0"]
    server = subprocess.Popen(
        command, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_banner(server)
        _discard_output(server)
        processes = _settled_tree(server.pid)
        server.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        server_exited = None
        while alive(processes):
            if server_exited is None and server.poll() is not None:
                server_exited = time.monotonic() - signalled_at
            if time.monotonic() - signalled_at > _TIMEOUT_S:
                raise TimeoutError(f"still running: {alive(processes)}")
            time.sleep(0.01)
        all_gone = time.monotonic() - signalled_at
        return {"server_exit_s": server_exited or all_gone, "all_gone_s": all_gone}
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def _wait_for_banner(server: subprocess.Popen[str]) -> None:
    assert server.stdout is not None
    output = []
    for line in server.stdout:
        output.append(line)
        if "Ctrl-C" in line:
            return
    raise RuntimeError("pdserve serve exited before serving:\n" + "".join(output))


def _discard_output(server: subprocess.Popen[str]) -> None:
    """Reads the rest of the server's output on a thread, so that its pipe never fills."""
    assert server.stdout is not None
    threading.Thread(target=server.stdout.read, daemon=True).start()


def _settled_tree(pid: int) -> list[TreeProcess]:
    """The tree of ``pid`` once it has kept the same processes for ``_SETTLED_S``."""
    processes = process_tree(pid)
    settled_since = time.monotonic()
    while time.monotonic() - settled_since < _SETTLED_S:
        time.sleep(0.1)
        now = process_tree(pid)
        if set(now) != set(processes):
            processes, settled_since = now, time.monotonic()
    return processes


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    all_gone = [run["all_gone_s"] for run in runs]
    return {
        "runs": runs,
        "all_gone_median_s": statistics.median(all_gone),
        "all_gone_min_s": min(all_gone),
        "all_gone_max_s": max(all_gone),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=_REPO, help="the checkout to measure")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="a checkout to compare")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then pdserve serve's")
    args = parser.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]
    trees = {"this": args.tree, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for index in range(args.repeat):
        for name, tree in trees.items():
            run = stop_once(tree, serve_args)
            runs[name].append(run)
            print(f"{name} #{index}: {run}", flush=True)
    results = {name: summary(name_runs) for name, name_runs in runs.items()}
    for name, result in results.items():
        print(
            f"{name}: all gone after {result['all_gone_median_s']:.2f} s median "
            f"({result['all_gone_min_s']:.2f}-{result['all_gone_max_s']:.2f} s, "
            f"{args.repeat} stops; load average {os.getloadavg()[0]:.1f})"
        )
    if args.result_json:
        trees_json = {name: str(tree) for name, tree in trees.items()}
        write_json(args.result_json, {"serve_args": serve_args, "trees": trees_json, **results})


if __name__ == "__main__":
    main()
