"""gpt-oss's MXFP4 experts on this CPU: the engine on the MXFP4 checkpoint against the engine on
the same weights in float32, in the same run.

    .venv/bin/python -m bench.mxfp4_experts [--rounds 2] [--out bench/results/mxfp4_experts.json]

A random gpt-oss of bench.offline_throughput's shape (hidden 256, 4 layers, 8 clamped-SwiGLU
experts, 2 per token), its experts 704 wide (a multiple of MXFP4's runs of 32), has its experts
quantized to MXFP4 (``quantize_mxfp4``) and is written twice: as MXFP4, the way OpenAI
publishes gpt-oss, and as float32 holding exactly the MXFP4 weights dequantized. Both run
bench.offline_throughput's workload (64 prompts of 32-512 tokens, 16-256 tokens each), the
order alternating over the rounds. Reported: output tokens/s of each, the experts' bytes each
holds, and whether the two give the same greedy tokens (they compute with the same weights:
the MXFP4 run dequantizes each expert with tokens for its step, the float run has them ready).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from bench.offline_throughput import _cpu_name, build_model, make_workload, run_engine
from bench.results_json import write_json
from engine import LLM, SamplingParams
from engine.quantization.mxfp4_experts import dequantize_mxfp4, quantize_mxfp4

VOCAB_SIZE = 8192
EXPERT_WIDTH = 704  # bench.offline_throughput's 688, rounded up to runs of 32
CHECK_PROMPTS = 8  # prompts whose greedy tokens both checkpoints must agree on
CHECK_TOKENS = 32


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """The random gpt-oss as MXFP4, and as float32 holding the same (dequantized) weights."""
    source = build_model(
        root / "source", VOCAB_SIZE, "gpt_oss", {"intermediate_size": EXPERT_WIDTH}
    )
    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            weight = dequantize_mxfp4(blocks, scales, torch.float32)
            dequantized[name] = weight.transpose(1, 2).contiguous()
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((source / "config.json").read_text())
    dirs = []
    for name, weights, quantization in (
        ("mxfp4", quantized, {"quant_method": "mxfp4"}),
        ("float", dequantized, None),
    ):
        model_dir = root / name
        model_dir.mkdir()
        save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        written = dict(config, quantization_config=quantization) if quantization else config
        (model_dir / "config.json").write_text(json.dumps(written))
        dirs.append(model_dir)
    return dirs[0], dirs[1]


def expert_bytes(model_dir: Path) -> int:
    """Bytes of the routed experts' weights in the checkpoint (biases left out)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    return sum(
        t.numel() * t.element_size()
        for name, t in tensors.items()
        if ".experts." in name and not name.endswith("_bias")
    )


def greedy_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each runs both checkpoints")
    parser.add_argument("--out", default="bench/results/mxfp4_experts.json")
    args = parser.parse_args(argv)
    prompts, output_lens = make_workload(args.num_prompts, VOCAB_SIZE, seed=0)
    warmup = make_workload(args.num_prompts, VOCAB_SIZE, seed=1)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        mxfp4_dir, float_dir = write_checkpoints(Path(tmp))
        dirs = {"mxfp4": mxfp4_dir, "float32": float_dir}
        for round_index in range(args.rounds):
            order = ("mxfp4", "float32") if round_index % 2 == 0 else ("float32", "mxfp4")
            for name in order:
                result = run_engine(dirs[name], prompts, output_lens, warmup)
                runs.append({"round": round_index, "weights": name, **result})
                print(f"round {round_index}, {name}: {result['tokens_per_second']:.0f} tok/s")
        check = prompts[:CHECK_PROMPTS]
        same_tokens = greedy_tokens(mxfp4_dir, check) == greedy_tokens(float_dir, check)
        bytes_held = {name: expert_bytes(d) for name, d in dirs.items()}
    means = {
        name: statistics.mean(r["tokens_per_second"] for r in runs if r["weights"] == name)
        for name in ("mxfp4", "float32")
    }
    print(
        f"mean tok/s: MXFP4 {means['mxfp4']:.0f}, float32 {means['float32']:.0f} "
        f"({means['mxfp4'] / means['float32']:.2f}x); experts' bytes {bytes_held['mxfp4']} "
        f"against {bytes_held['float32']} ({bytes_held['mxfp4'] / bytes_held['float32']:.3f}x); "
        f"greedy tokens equal: {same_tokens}"
    )
    payload = {
        "benchmark": "mxfp4_experts",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": _cpu_name(), "torch": torch.__version__},
        "model": {"kind": "gpt_oss", "expert_width": EXPERT_WIDTH, "vocab_size": VOCAB_SIZE},
        "runs": runs,
        "mean_tokens_per_second": means,
        "mxfp4_over_float32": means["mxfp4"] / means["float32"],
        "expert_bytes": bytes_held,
        "greedy_tokens_equal": same_tokens,
    }
    print(f"-> {write_json(args.out, payload)}")
    if not same_tokens:
        raise SystemExit("greedy tokens of the MXFP4 and the float checkpoint differ")


if __name__ == "__main__":
    main()
