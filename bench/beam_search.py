"""Beam search: ``LLM.beam_search`` against transformers ``generate(num_beams=...)`` on the same
weights, same prompts, same width and length.

    .venv/bin/python -m bench.beam_search [--num-prompts 16] [--beam-width 4]
        [--max-tokens 32] [--block-size 16] [--out bench/results/x.json]

The model is bench.offline_throughput's random Llama (hidden 256, 4 layers, vocab 8192); the
prompts are 32-256 tokens; eos is ignored on both sides (every beam runs ``max-tokens``), so the
work is fixed. pdserve searches every prompt at once, each step one request per running beam
(its prompt and the beam so far, the prefix cache serving every full block: a step computes the
beam's last partial block); transformers searches batches of ``--hf-batch`` prompts,
left-padded, its KV cache reordered between steps. Reported: seconds, beam tokens per second
(prompts x width x max_tokens over the seconds), and the prompts whose beams both find alike.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.offline_throughput import build_model
from engine import LLM, BeamSearchParams

VOCAB_SIZE = 8192


def make_prompts(num_prompts: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(32, 256))]
        for _ in range(num_prompts)
    ]


def run_pdserve(
    model_dir: Path, prompts: list[list[int]], params: BeamSearchParams, block_size: int
) -> tuple[dict, list[list[list[int]]]]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=block_size,
        skip_tokenizer_init=True,
    )
    llm.beam_search(make_prompts(len(prompts), seed=1), params)  # warm-up, other prompts
    started = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - started
    beams = [[s.output_token_ids for s in output.sequences] for output in outputs]
    return {"seconds": seconds, "engine_steps": llm.engine.stats.num_steps}, beams


def run_transformers(
    model_dir: Path, prompts: list[list[int]], params: BeamSearchParams, batch_size: int
) -> tuple[dict, list[list[list[int]]]]:
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

    search(make_prompts(batch_size, seed=1))  # warm-up
    beams: list[list[list[int]]] = []
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        beams += search(prompts[start : start + batch_size])
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "batch_size": batch_size}, beams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    params = BeamSearchParams(
        beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True
    )
    prompts = make_prompts(args.num_prompts, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), VOCAB_SIZE)
        pdserve, ours = run_pdserve(model_dir, prompts, params, args.block_size)
        hf, theirs = run_transformers(model_dir, prompts, params, args.hf_batch)
    beam_tokens = args.num_prompts * args.beam_width * args.max_tokens
    for side in (pdserve, hf):
        side["beam_tokens_per_second"] = beam_tokens / side["seconds"]
    result = {
        "workload": {
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
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
