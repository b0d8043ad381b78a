"""The planner's step roofline against the engine's own steps, one model shape beside another.

    .venv/bin/python -m bench.plan_roofline [--size cpu|gpu] [--device cpu] [--hardware FILE]

``pdserve plan`` predicts a step's time from a model's config.json and a hardware profile
(router/planner/hardware.py): compute against memory, where a mixture of experts reads the
experts its step's tokens go to and a decode row of a sliding-window layer reads its window.
This runs the engine on random weights of four shapes of one size (a dense Llama, a Mixtral of
8 experts routing each token to 2 as wide as the dense MLP together, a Qwen2 whose later half of
layers slide, a DeepSeek-V3 of latent attention and dense MLPs), times its decode steps at each
batch size and context and a prompt step, and sets each step beside the roofline's prediction
for the same step, and beside the prediction without the count (every expert read; every
layer's whole context; latent attention up-projected, 2 x heads x (qk + v head dims) FLOPs a
pair, where the engine's absorbed form costs 2 x heads x (2 x kv_lora_rank + rope dims)) for
contrast.

The hardware profile is ``--hardware`` (a ``pdserve profile`` JSON: on a GPU, that of
``bash bench/gpu/lease.sh profile``), else measured here by ``pdserve profile`` on the dense
shape. Every shape is predicted by the roofline from the profile's effective rates (its own fit
of the dense shape set aside), so the dense shape's ratio is the roofline's own error and the
other shapes' ratios beside it show whether the counts follow the engine. A step is timed as
the engine ran it alone (``StepTiming``, no engine loop). Writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from engine.kv_cache.cache_groups import CacheGroups
from engine.messages import StepTiming
from router.latency_model import StepShape
from router.planner.hardware import Hardware, StepTimeModel, hardware_named
from router.planner.model_costs import ModelCosts


@dataclass(frozen=True, slots=True)
class Size:
    """The shapes' common size, and what is run on them."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's width; each of the 8 experts' is a quarter of it
    vocab: int
    window: int  # the sliding layers' window, in tokens
    contexts: tuple[int, ...]  # each decode batch's prompt length
    batch_sizes: tuple[int, ...]
    prompt_tokens: int  # the prompt step's
    dtype: str
    num_kv_blocks: int


SIZES = {
    # about 100 M parameters dense: weights well beyond a CPU's caches, steps of tens of ms
    "cpu": Size(1024, 8, 16, 8, 64, 2816, 8192, 128, (256, 1024), (1, 4, 16), 512, "float32",
                1600),
    # the tests' (seconds on a CPU)
    "tiny": Size(64, 4, 4, 2, 16, 128, 512, 16, (32, 96), (1, 4), 64, "float32", 256),
    # Llama-3-8B's and Mixtral's layers, eight of them
    "gpu": Size(4096, 8, 32, 8, 128, 14336, 128256, 1024, (512, 4096), (1, 8, 64, 256), 2048,
                "bfloat16", 80000),
}  # fmt: skip
NUM_EXPERTS, EXPERTS_PER_TOKEN = 8, 2
DECODE_STEPS = 12  # a batch's decode steps; its first two are warm-up, not timed
_WARMUP_STEPS = 2


def shape_configs(size: Size) -> dict[str, dict[str, Any]]:
    """The four shapes' config.json, by name."""
    common = {
        "hidden_size": size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.head_dim,
        "vocab_size": size.vocab,
        # a batch's prompts and the tokens of its steps, all of them prefilling at most
        "max_position_embeddings": max(size.contexts)
        + max(size.contexts) * max(size.batch_sizes) // size.prompt_tokens
        + 2 * DECODE_STEPS
        + size.prompt_tokens,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": size.dtype,
    }
    return {
        "dense": {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "intermediate_size": size.intermediate,
        },
        "moe": {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": size.intermediate // EXPERTS_PER_TOKEN,
            "num_local_experts": NUM_EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "sliding_window": None,
        },
        "sliding": {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "intermediate_size": size.intermediate,
            "use_sliding_window": True,
            "sliding_window": size.window,
            "max_window_layers": size.layers // 2,  # layers from here on slide
        },
        "mla": {
            **common,
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "intermediate_size": size.intermediate,
            "num_key_value_heads": size.heads,  # (transformers' MLA: one K/V per query head)
            "q_lora_rank": size.hidden // 2,
            "kv_lora_rank": 4 * size.head_dim,
            "qk_nope_head_dim": size.head_dim,
            "qk_rope_head_dim": size.head_dim // 2,
            "head_dim": size.head_dim // 2,  # (its config's name for the rope dims)
            "v_head_dim": size.head_dim,
            "first_k_dense_replace": size.layers,  # every MLP dense: the attention alone differs
            "n_routed_experts": NUM_EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
        },
    }


def with_counts_left_out(name: str, costs: ModelCosts, config: dict[str, Any]) -> ModelCosts:
    """The shape's costs without what the roofline counts as the engine does (a sliding
    window's count is in the step's shape instead: ``decode_shape``): every expert's weights
    read; latent attention up-projected."""
    if name == "moe":
        return dataclasses.replace(costs, routed_expert_bytes=0)
    if name == "mla":
        head_dims = config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]
        pair = 2.0 * config["num_attention_heads"] * head_dims * config["num_hidden_layers"]
        return dataclasses.replace(costs, attention_flops_per_pair=pair)
    return costs


def write_model(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def measure_hardware(model_dir: Path, device: str, dtype: str, out: Path) -> Hardware:
    """``pdserve profile`` of the model on this machine (random weights), as a user runs it."""
    command = [
        sys.executable, "-m", "router.cli", "profile", "--model", str(model_dir),
        "--load-format", "dummy", "--device", device, "--dtype", dtype, "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return Hardware.load(out)


def roofline(hardware: Hardware) -> Hardware:
    """The profile with its own fit set aside and its host's sharing left out: a step alone,
    predicted from the effective rates."""
    return dataclasses.replace(hardware, measured=None, measured_model="", host_cores=0)


def decode_shape(timing: StepTiming, groups: CacheGroups | None) -> StepShape:
    """A decode step's shape as the planner's roofline takes it; with sliding windows, the KV
    read and pairs averaged over the layers (``engine.step_timings.roofline_counts``), its rows
    taken at their mean position (exact where every row is past the window: a sliding layer
    reads the window, a full one the row's context)."""
    rows = timing.num_decode_tokens
    shape = StepShape(0, 0, rows, timing.decode_context_tokens)
    if groups is None:
        return shape
    position = timing.decode_context_tokens // rows - 1
    return dataclasses.replace(
        shape,
        decode_kv_tokens=rows * groups.mean_positions_read(position + 1),
        attention_pairs=rows * groups.mean_pairs(position, 1),
    )


def prompt_shape(timing: StepTiming, groups: CacheGroups | None) -> StepShape:
    """A prompt step of one prompt from position 0."""
    shape = StepShape(timing.num_prefill_tokens, timing.prefill_attention_tokens)
    if groups is None:
        return shape
    return dataclasses.replace(
        shape, attention_pairs=groups.mean_pairs(0, timing.num_prefill_tokens)
    )


def run_shape(model_dir: Path, size: Size, device: str, threads: int, seed: int) -> list[dict]:
    """The engine's prompt step and decode steps on the model, each as a dict of its shape and
    seconds (``kind``: "prompt" or "decode"; ``batch``, ``context``)."""
    import torch

    from engine.engine_config import CacheConfig, LoadConfig
    from engine.kv_cache.budget import KVBudget
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from engine.scheduler import SchedulerConfig
    from engine.step_timings import StepTimingLog

    if device == "cpu":
        torch.set_num_threads(threads)
    engine = LLMEngine(
        LoadConfig(str(model_dir), dtype=size.dtype, device=device, load_format="dummy"),
        CacheConfig(block_size=16, budget=KVBudget(num_blocks=size.num_kv_blocks)),
        SchedulerConfig(
            max_num_seqs=max(size.batch_sizes),
            max_num_batched_tokens=max(size.prompt_tokens, max(size.batch_sizes)),
        ),
    )
    engine.step_timings = StepTimingLog(1 << 16)
    rng = random.Random(seed)
    budget = engine.scheduler.config.max_num_batched_tokens

    def run(batch: int, prompt_len: int, name: str) -> tuple[StepTiming, ...]:
        """The batch's steps until, all its prompts prefilled (the first decode while the last
        prefill), it has decoded together for ``_WARMUP_STEPS + DECODE_STEPS`` steps; then
        the batch is aborted."""
        prefill_steps = -(-batch * prompt_len // budget)
        tokens = prefill_steps + _WARMUP_STEPS + DECODE_STEPS + 1
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        ids = [f"{name}-{i}" for i in range(batch)]
        for request_id in ids:
            prompt = [rng.randrange(3, size.vocab) for _ in range(prompt_len)]
            engine.add_request(request_id, prompt, params)
        scheduler = engine.scheduler
        while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
            engine.step()
        for _ in range(_WARMUP_STEPS + DECODE_STEPS):
            engine.step()
        for request_id in ids:
            engine.abort_request(request_id)
        return engine.step_timings.take()

    rows: list[dict] = []
    try:
        run(2, 32, "warm-up")
        run(1, size.prompt_tokens, "prompt-warm-up")  # (oneDNN builds its kernels per row count)
        for timing in run(1, size.prompt_tokens, "prompt"):
            if timing.num_prefill_tokens == size.prompt_tokens and not timing.num_decode_tokens:
                rows.append({"kind": "prompt", "batch": 1, "context": 0, "timing": timing})
        for context in size.contexts:
            for batch in size.batch_sizes:
                decode = [
                    t
                    for t in run(batch, context, f"decode-{context}-{batch}")
                    if not t.num_prefill_tokens and t.num_decode_tokens == batch
                ]
                for timing in decode[_WARMUP_STEPS:]:
                    rows.append(
                        {"kind": "decode", "batch": batch, "context": context, "timing": timing}
                    )
    finally:
        engine.close()
    return rows


def predicted(
    rows: list[dict], costs: ModelCosts, plain_costs: ModelCosts, hardware: Hardware, name: str
) -> list[dict[str, Any]]:
    """Each (kind, batch, context) point's median measured step beside the roofline's
    prediction, and the prediction without the shape's count (``plain_costs``, every layer's
    whole context)."""
    model = StepTimeModel(costs, hardware)
    plain = StepTimeModel(plain_costs, hardware)
    groups = costs.cache_groups
    points: dict[tuple[str, int, int], list[tuple[float, float, float]]] = {}
    for row in rows:
        timing: StepTiming = row["timing"]
        if row["kind"] == "prompt":
            shape, whole = prompt_shape(timing, groups), prompt_shape(timing, None)
        else:
            shape, whole = decode_shape(timing, groups), decode_shape(timing, None)
        key = (row["kind"], row["batch"], row["context"])
        points.setdefault(key, []).append((timing.seconds, model(shape), plain(whole)))
    out = []
    for (kind, batch, context), samples in sorted(points.items()):
        measured = statistics.median(s[0] for s in samples)
        roof = statistics.median(s[1] for s in samples)
        without = statistics.median(s[2] for s in samples)
        out.append(
            {
                "shape": name,
                "kind": kind,
                "batch": batch,
                "context": context,
                "steps": len(samples),
                "measured_ms": measured * 1e3,
                "predicted_ms": roof * 1e3,
                "without_count_ms": without * 1e3,
                "ratio": measured / roof,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--hardware", help="a pdserve profile JSON or a preset's name (default: measured here)"
    )
    parser.add_argument("--shapes", default="dense,moe,sliding,mla")
    parser.add_argument("--layers", type=int, help="the shapes' layers (default: the size's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/plan_roofline.json")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    if args.layers:
        size = dataclasses.replace(size, layers=args.layers)
    configs = shape_configs(size)
    names = [n for n in args.shapes.split(",") if n]
    for name in names:
        if name not in configs:
            parser.error(f"--shapes: {name!r} is not one of {', '.join(configs)}")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="plan-roofline-") as scratch:
        root = Path(scratch)
        dirs = {name: write_model(root / name, configs[name]) for name in configs}
        profiled = (
            hardware_named(args.hardware)
            if args.hardware
            else measure_hardware(dirs["dense"], args.device, size.dtype, root / "hardware.json")
        )
        hardware = roofline(profiled)
        threads = profiled.worker_threads or 1
        results = []
        for name in names:
            costs = ModelCosts.load(dirs[name], size.dtype)
            plain_costs = with_counts_left_out(name, costs, configs[name])
            rows = run_shape(dirs[name], size, args.device, threads, args.seed)
            results.extend(predicted(rows, costs, plain_costs, hardware, name))
    print(f"{'shape':>8} {'kind':>6} {'batch':>5} {'context':>7} {'measured':>9} "
          f"{'predicted':>9} {'without':>8} {'ratio':>6}")  # fmt: skip
    for r in results:
        print(
            f"{r['shape']:>8} {r['kind']:>6} {r['batch']:>5} {r['context']:>7} "
            f"{r['measured_ms']:8.2f}m {r['predicted_ms']:8.2f}m {r['without_count_ms']:7.2f}m "
            f"{r['ratio']:6.2f}"
        )
    payload = {
        "benchmark": "plan_roofline",
        "command": " ".join(["python -m bench.plan_roofline", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "size": dataclasses.asdict(size),
        "device": args.device,
        "hardware": profiled.to_json(),
        "results": results,
    }
    print(f"wrote {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
