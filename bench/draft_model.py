"""Speculative decoding with a draft model against the same target without it, and against
prompt lookup, in the same run.

    .venv/bin/python -m bench.draft_model [--model DIR --draft-models DIR[,DIR]] [--device cpu]
        [--batch-sizes 1,4,16] [--output-len 128] [--num-speculative-tokens 4] [--repeats 3]
        [--threads 1] [--deepen-to 24] [--vllm-python /tmp/vllm-venv/bin/python]
        [--out bench/results/draft_model.json]

Without ``--model`` the pair is built from the bundled demo model, which is the only trained
model this repository has: the target is the demo model deepened to ``--deepen-to`` layers,
the added layers' output projections (``o_proj``, ``down_proj``) zero, so they add nothing to
the residual stream: its text is the demo model's while a forward runs 4x the layers (24 of
6). The drafts: ``exact``, the demo model itself (every greedy draft stands: the bound), and
``noisy``, a copy of it with every matrix element scaled by 1 + 0.3 x N(0, 1) (about half
stand). Prompts: 24-token starts of docstrings from the demo model's corpus; greedy, ``ignore_eos``,
``--output-len`` tokens each; prefix cache off. Each engine runs the same requests
``--repeats`` times, alternating; the median wall time gives output tokens/s. Every engine's
outputs are compared with the baseline's (greedy must not change). Prints a table and writes
JSON with the acceptance rate and the steps. With ``--vllm-python`` (a venv holding vLLM's CPU
build: ../shared/ENVIRONMENT.md), vLLM runs the same target, drafts (its ``draft_model``
method; no ngram) and prompts, each in a process of its own pinned to as many cores as
``--threads`` (``VLLM_CPU_OMP_THREADS_BIND``), the same repeats, timed the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from bench.speculative import DEMO_MODEL, add_drafting_args, docstring_prompts, drafting_report
from bench.vllm_side import run_vllm_job
from engine import LLM

NOISE = 0.3  # the noisy draft's relative scale of each matrix element's noise


def deepened_demo(out: Path, num_layers: int) -> Path:
    """The demo model with layers added after its own whose attention and MLP outputs are
    zero: the same function, ``num_layers`` layers of compute."""
    shutil.copytree(DEMO_MODEL, out, dirs_exist_ok=True)
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    own = int(config["num_hidden_layers"])
    weights = load_file(DEMO_MODEL / "model.safetensors")
    for layer in range(own, num_layers):
        for name, tensor in list(weights.items()):
            if name.startswith(f"model.layers.{layer % own}."):
                added = name.replace(f"layers.{layer % own}.", f"layers.{layer}.", 1)
                silent = name.endswith(("o_proj.weight", "down_proj.weight"))
                weights[added] = torch.zeros_like(tensor) if silent else tensor.clone()
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def noisy_demo(out: Path, seed: int = 0) -> Path:
    """The demo model, each matrix element scaled by 1 + NOISE x N(0, 1)."""
    shutil.copytree(DEMO_MODEL, out, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(DEMO_MODEL / "model.safetensors")
    for name, weight in weights.items():
        if weight.dim() == 2:
            noise = 1 + NOISE * torch.randn(weight.shape, generator=generator)
            weights[name] = (weight.float() * noise).to(weight.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def make_engines(target: str, drafts: dict[str, str], args: argparse.Namespace) -> dict[str, LLM]:
    """The baseline, prompt lookup, then a drafting engine per draft model."""
    k = args.num_speculative_tokens
    configs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3},
    }  # fmt: skip
    for name, path in drafts.items():
        configs[name] = {"model": path, "num_speculative_tokens": k}
    return {
        name: LLM(
            target,
            dtype=args.dtype,
            device=args.device,
            enable_prefix_caching=False,  # every repeat computes its prompts
            speculative_config=config,
        )
        for name, config in configs.items()
    }


def vllm_runs(
    args: argparse.Namespace, target: str, drafts: dict[str, str], batches: list[list[list[int]]]
) -> dict[str, list[dict[str, Any]]]:
    """vLLM's runs of each batch without drafts, then with each draft model, by name."""
    return {name: run_vllm(args, target, draft, batches)
            for name, draft in {"none": None, **drafts}.items()}  # fmt: skip


def run_vllm(
    args: argparse.Namespace, target: str, draft: str | None, batches: list[list[list[int]]]
) -> list[dict[str, Any]]:
    """vLLM's greedy runs of each batch of prompts, ``draft`` drafting (None: none), in its own
    venv's process (bench/vllm_side.py): per batch, the median seconds and tokens."""
    spec = None
    if draft is not None:
        spec = {"method": "draft_model", "model": draft,
                "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
    job = {"target": target, "speculative_config": spec, "batches": batches,
           "output_len": args.output_len, "repeats": args.repeats, "dtype": "float32"}  # fmt: skip
    return run_vllm_job(args.vllm_python, args.threads, job)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the deepened demo)")
    parser.add_argument("--draft-models", default=None, help="comma-separated (with --model)")
    parser.add_argument("--deepen-to", type=int, default=24)
    add_drafting_args(parser, 4, "bench/results/draft_model.json")
    args = parser.parse_args(argv)
    if (args.model is None) != (args.draft_models is None):
        parser.error("--model and --draft-models go together")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        if args.model is None:
            target = str(deepened_demo(Path(scratch) / "target", args.deepen_to))
            drafts = {"exact": str(DEMO_MODEL), "noisy": str(noisy_demo(Path(scratch) / "noisy"))}
        else:
            target = args.model
            drafts = {Path(d).name: d for d in args.draft_models.split(",")}
        engines = make_engines(target, drafts, args)
        batches = [
            docstring_prompts(engines["none"], batch_size, args.seed + batch_size)
            for batch_size in (int(b) for b in args.batch_sizes.split(","))
        ]
        return drafting_report(
            engines, batches, args, lambda: vllm_runs(args, target, drafts, batches)
        )


if __name__ == "__main__":
    main()
