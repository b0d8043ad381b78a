"""Engine against engine, no server: pdserve's ``LLM`` and vLLM's on the same requests.

    .venv/bin/python -m bench.offline_vs_vllm --vllm-python /work/vllm-venv/bin/python
        [--dtype float32|bfloat16]

Both get the same chat-like workload (the serving benchmark's generator and defaults: prompts
lognormal around 192 tokens, 16-400; outputs around 48, 8-100; greedy, ``ignore_eos``) as
token ids, all at once, and the time to finish them all is measured, after a warm-up request.
Each run is a fresh process, the systems alternating, ``--repeats`` times each (this machine's
timings move by 20 % from run to run). pdserve runs one torch thread, as a serving worker does;
vLLM (``enforce_eager``, ``VLLM_CPU_KVCACHE_SPACE=1``) binds its own. Both load the weights in
``--dtype`` (the checkpoint's float32 by default; bfloat16 is what models are served in). Writes
JSON.

This file is also the worker each run executes (``--worker``): it imports nothing of pdserve
at the top, so vLLM's Python can run it by path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "engine" / "demo_model" / "assets"


def _run_pdserve(requests: list[dict[str, Any]], model_dir: str, dtype: str) -> float:
    import torch

    torch.set_num_threads(1)
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, device="cpu", num_kv_blocks=2048, max_model_len=512)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([list(range(5, 55))], [warm_up])
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in requests
    ]
    started = time.perf_counter()
    llm.generate([r["token_ids"] for r in requests], params)
    return time.perf_counter() - started


def _run_vllm(requests: list[dict[str, Any]], model_dir: str, dtype: str) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model_dir, dtype=dtype, max_model_len=512, enforce_eager=True, seed=0)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(5, 55)))], warm_up, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["token_ids"]) for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in requests
    ]
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def _worker(system: str, requests_path: str, model_dir: str, dtype: str) -> None:
    requests = json.loads(Path(requests_path).read_text())
    seconds = (_run_pdserve if system == "pdserve" else _run_vllm)(requests, model_dir, dtype)
    print("RESULT " + json.dumps({"seconds": seconds}))


def _build_requests(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    from bench.serving.tokens import TokenCodec
    from bench.serving.workloads import WorkloadSpec, build_requests

    codec = TokenCodec.load(MODEL_DIR)
    spec = WorkloadSpec("chat-like", 192, 48, (16, 400), (8, 100))
    return [
        {
            "token_ids": codec.tokenizer.encode(r.prompt, add_special_tokens=False),
            "max_tokens": r.output_len,
        }
        for r in build_requests(spec, codec, num_prompts, seed)
    ]


def _one_run(python: str, system: str, requests_path: str, dtype: str) -> float:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if system == "pdserve":
        env["PYTHONPATH"] = str(REPO)
    command = [python, str(Path(__file__).resolve()), "--worker", system, requests_path, dtype]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(json.loads(line.removeprefix("RESULT "))["seconds"])
    raise RuntimeError(f"{system} run failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    parser.add_argument("--num-prompts", type=int, default=240)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default="bench/results/offline_vs_vllm.json")
    args = parser.parse_args()
    from bench.results_json import write_json

    requests = _build_requests(args.num_prompts, args.seed)
    num_output = sum(r["max_tokens"] for r in requests)
    pythons = {"pdserve": sys.executable, "vllm": args.vllm_python}
    seconds: dict[str, list[float]] = {system: [] for system in pythons}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(requests, file)
        file.flush()
        for repeat in range(args.repeats):
            for system, python in pythons.items():
                run_s = _one_run(python, system, file.name, args.dtype)
                seconds[system].append(run_s)
                print(f"run {repeat + 1} {system:>7}: {len(requests) / run_s:6.2f} req/s")
    summary = {
        system: {
            "median_req_per_s": len(requests) / statistics.median(runs),
            "best_req_per_s": len(requests) / min(runs),
            "median_output_tok_per_s": num_output / statistics.median(runs),
            "seconds": runs,
        }
        for system, runs in seconds.items()
    }
    for system, row in summary.items():
        print(
            f"{system:>7}: median {row['median_req_per_s']:6.2f} req/s, best "
            f"{row['best_req_per_s']:6.2f}, {row['median_output_tok_per_s']:7.0f} output tok/s"
        )
    payload = {
        "benchmark": "offline_vs_vllm",
        "date": time.strftime("%Y-%m-%d"),
        "dtype": args.dtype,
        "num_prompts": len(requests),
        "prompt_tokens": sum(len(r["token_ids"]) for r in requests),
        "output_tokens": num_output,
        "summary": summary,
    }
    print(f"-> {write_json(args.out, payload)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        # run by path, this folder leads sys.path, where its modules would shadow packages of the
        # same name (bench/kv_transfer.py): pdserve's worker reads the repository's instead
        if sys.argv[2] == "pdserve":
            sys.path[0] = str(REPO)
        else:
            del sys.path[0]
        _worker(sys.argv[2], sys.argv[3], str(MODEL_DIR), sys.argv[4])
    else:
        main()
