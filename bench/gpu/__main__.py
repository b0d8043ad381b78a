"""``python -m bench.gpu``: parse the flags, resolve the preset, run each section, report.

The JSON is rewritten after every section; a failing section is recorded under "errors".
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import bench.gpu
from bench.gpu.attention_tiling import (
    measure_decode_tilings,
    measure_prefill_tilings,
    measure_verify_attention,
)
from bench.gpu.elementwise import measure_elementwise
from bench.gpu.engine_runs import max_model_len, run_pdserve
from bench.gpu.hf_baseline import measure_transformers
from bench.gpu.quantized import (
    gemm_token_counts,
    measure_quantized_gemms,
    measure_quantized_kv_attention,
)
from bench.gpu.report import machine_info, print_report
from bench.gpu.shapes import MODELS, PRESETS, ModelSpec, Preset
from bench.gpu.targets import verdicts
from bench.gpu.timing import (
    free_memory,
    log,
    measure_ceilings,
    peak_flop_per_s,
    read_bytes_per_s,
    seconds_since_start,
)
from bench.gpu.transfer import measure_transfer
from bench.results_json import write_json
from engine.kernels.checks import interpreted

ONLY_SECTIONS = ("quantized",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=(bench.gpu.__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--quick", action="store_true", help="the quick preset (about 4 min)")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--batch-sizes", default=None, help="comma list, e.g. 1,64")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-transfer", action="store_true")
    parser.add_argument(
        "--only",
        choices=ONLY_SECTIONS,
        default=None,
        help="the ceilings and this section alone (no targets): quantized = the quantized "
        "GEMMs and the 8-bit KV cache's decode attention, against bf16",
    )
    parser.add_argument("--out", default="bench/results/gpu.json")
    return parser.parse_args(argv)


def resolve_preset(args: argparse.Namespace, device: torch.device) -> tuple[str, Preset]:
    name = args.preset or ("quick" if args.quick else "full" if device.type == "cuda" else "tiny")
    preset = PRESETS[name]
    if args.models:
        models = tuple(m.strip() for m in args.models.split(","))
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            raise SystemExit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
        preset = dataclasses.replace(preset, models=models)
    if args.batch_sizes:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
        preset = dataclasses.replace(preset, batch_sizes=batch_sizes)
    return name, preset


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    preset_name, preset = resolve_preset(args, device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    result: dict[str, Any] = {
        "benchmark": "gpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, "-m", "bench.gpu", *sys.argv[1:]]),
        "machine": machine_info(device),
        "dtype": dtype,
        "preset_name": preset_name,
        "preset": dataclasses.asdict(preset),
    }
    log(f"{result['machine']['name']}, torch {torch.__version__}, preset {preset_name}")
    result["ceilings"] = measure_ceilings(device, dtype, preset)
    specs = [MODELS[name] for name in preset.models]
    # keyed by the spec's name, as the sections read it
    result["models"] = {
        spec.name: {"spec": dataclasses.asdict(spec), "num_params": spec.num_params}
        for spec in specs
    }
    run = BenchRun(device, dtype, preset, result, args.out, judge_targets=args.only is None)
    run.save()
    # What the targets need first (a lease's time box may end the run), then what tunes.
    if args.only is None:
        for spec in specs:
            run_model_targets(run, spec, not args.no_transformers)
        if not args.no_transfer:
            run.section(
                result, "kv_transfer", lambda: measure_transfer(specs[0], device, dtype, preset)
            )
        for spec in specs:
            run_model_tuning(run, spec)
    for spec in specs:
        run_model_quantized(run, spec)
    result["seconds"] = seconds_since_start()
    run.save()
    print_report(result)
    print(f"-> {args.out}")


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One run's device, dtype and preset, and the result it writes after every section."""

    device: torch.device
    dtype: str
    preset: Preset
    result: dict[str, Any]
    out: str
    judge_targets: bool = True  # False (``--only``): the run measures nothing the targets read

    def section(self, into: dict[str, Any], key: str, measure: Callable[[], Any]) -> None:
        """``into[key] = measure()`` (a failure recorded instead: ``attempt``), then saved."""
        attempt(into, key, measure, self.device)
        self.save()

    def save(self) -> None:
        """Rewrites the JSON, verdicts included: a run cut short keeps what it measured."""
        self.result["targets"] = verdicts(self.result) if self.judge_targets else []
        write_json(self.out, self.result)


def run_model_targets(run: BenchRun, spec: ModelSpec, run_transformers: bool) -> None:
    """pdserve, then transformers, on one written config, into the model's result; a failing
    part is recorded and the other goes on."""
    device, dtype, preset = run.device, run.dtype, run.preset
    ceilings = run.result["ceilings"]
    model: dict[str, Any] = run.result["models"][spec.name]
    with tempfile.TemporaryDirectory(prefix=f"bench-gpu-{spec.name}-") as tmp:
        model_dir = spec.write_config(Path(tmp), max_model_len(preset) + 16, dtype)
        run.section(
            model, "pdserve", lambda: run_pdserve(spec, model_dir, device, dtype, preset, ceilings)
        )
        if run_transformers:
            run.section(
                model,
                "transformers",
                lambda: measure_transformers(spec, model_dir, device, dtype, preset),
            )


def run_model_tuning(run: BenchRun, spec: ModelSpec) -> None:
    """The sections that pick defaults (fused elementwise kernels, attention tilings) into the
    model's result."""
    device, dtype, preset = run.device, run.dtype, run.preset
    model: dict[str, Any] = run.result["models"][spec.name]
    read_bw = read_bytes_per_s(run.result["ceilings"])
    peak_flops = peak_flop_per_s(run.result["ceilings"])
    run.section(
        model,
        "elementwise",
        lambda: measure_elementwise(
            spec, device, dtype, preset.elementwise_tokens, preset.num_reps, read_bw
        ),
    )
    if device.type == "cuda" or interpreted():
        run.section(
            model,
            "attention_tilings",
            lambda: measure_attention_tilings(spec, device, dtype, preset, read_bw, peak_flops),
        )


def run_model_quantized(run: BenchRun, spec: ModelSpec) -> None:
    """The quantized paths' kernels against bf16 (bench/gpu/quantized.py) into the model's
    result: the GEMMs, then decode attention over the 8-bit KV caches, each saved when done."""
    device, dtype, preset = run.device, run.dtype, run.preset
    if not (device.type == "cuda" or interpreted()):
        return  # the Triton kernels launch only on a GPU or in the interpreter
    model: dict[str, Any] = run.result["models"][spec.name]
    read_bw = read_bytes_per_s(run.result["ceilings"])
    token_counts = gemm_token_counts(preset.elementwise_tokens)
    run.section(
        model,
        "quantized_gemm",
        lambda: measure_quantized_gemms(
            spec, device, dtype, token_counts, preset.num_reps, read_bw
        ),
    )
    run.section(
        model,
        "quantized_kv_attention",
        lambda: measure_quantized_kv_attention(
            spec, device, dtype, list(preset.batch_sizes), preset.context_len, preset.num_reps,
            read_bw,
        ),
    )  # fmt: skip


def measure_attention_tilings(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    preset: Preset,
    read_bw: float,
    peak_flops: float,
) -> dict[str, Any]:
    batch_sizes = list(preset.batch_sizes)
    return {
        "decode": measure_decode_tilings(
            spec, device, dtype, batch_sizes, preset.context_len, preset.num_reps, read_bw
        ),
        "prefill": measure_prefill_tilings(
            spec, device, dtype, preset.prefill_lens, preset.num_reps, peak_flops
        ),
        "verify": measure_verify_attention(
            spec, device, dtype, batch_sizes, preset.context_len, preset.num_reps, read_bw
        ),
    }


def attempt(
    into: dict[str, Any], key: str, measure: Callable[[], Any], device: torch.device
) -> None:
    """``into[key] = measure()``; on failure the error goes to ``into["errors"][key]`` instead.

    One section failing (say, out of memory) must not lose the others of a one-shot GPU run.
    """
    try:
        into[key] = measure()
    except Exception as exc:
        traceback.print_exc()
        into.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
        log(f"{key} failed: {type(exc).__name__}: {exc}")
    free_memory(device)


if __name__ == "__main__":
    main()
