"""bench.gpu's text report: the machine, its ceilings, the per-model tables, the targets."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

import torch

from bench.gpu.shapes import MIB


def machine_info(device: torch.device) -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "device": device.type,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info["name"] = properties.name
        info["memory_bytes"] = properties.total_memory
        info["capability"] = f"{properties.major}.{properties.minor}"
    else:
        info["name"] = info["cpu"]
    return info


def print_report(result: dict[str, Any]) -> None:
    machine, ceilings = result["machine"], result["ceilings"]
    copy, matmul = ceilings["copy"], ceilings["matmul"]
    print(
        f"\n{machine['name']}  torch {machine['torch']}  triton {machine['triton']}  "
        f"transformers {machine['transformers']}  ({result['dtype']})"
    )
    print(
        f"copy {copy['nbytes'] / MIB:g} MiB: {copy['read_write_gb_per_s']:.1f} GB/s read+write "
        f"({copy['copied_gb_per_s']:.1f} GB/s copied); matmul {matmul['n']}^3 "
        f"{matmul['dtype']}: {matmul['flop_per_s'] / 1e12:.2f} TFLOP/s"
    )
    if result["machine"]["device"] != "cuda":
        print("(not a GPU: these numbers only show that the script runs)")
    for name, model in result["models"].items():
        if "elementwise" in model:
            print_elementwise(name, model["elementwise"])
        if "attention_tilings" in model:
            print_attention_tilings(name, model["attention_tilings"])
        if "pdserve" in model:
            print_model(name, model)
        if "quantized_gemm" in model:
            print_quantized_gemm(name, model["quantized_gemm"])
        if "quantized_kv_attention" in model:
            print_quantized_kv_attention(name, model["quantized_kv_attention"])
    if "kv_transfer" in result:
        print_transfer(result["kv_transfer"])
    print_targets(result["targets"])
    errors = {**result.get("errors", {})}
    for name, model in result["models"].items():
        errors.update({f"{name} {key}": e for key, e in model.get("errors", {}).items()})
    for key, error in errors.items():
        print(f"  ERROR {key}: {error}")


def print_elementwise(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{name}: one forward's elementwise steps (torch ops against fused Triton kernels)")
    print(f"{'tokens':>6}{'torch ms':>10}{'fused ms':>10}{'speedup':>9}{'floor ms':>10}")
    for r in rows:
        fused = (
            f"{r['fused_ms']:>10.3f}{r['speedup']:>8.2f}x"
            if "fused_ms" in r
            else f"{'-':>10}{'-':>9}"
        )
        print(f"{r['tokens']:>6}{r['torch_ms']:>10.3f}{fused}{r['floor_ms']:>10.3f}")


def print_attention_tilings(name: str, tilings: dict[str, list[dict[str, Any]]]) -> None:
    def tiling(row: dict[str, Any]) -> str:
        shown = " ".join(f"{k}={v}" for k, v in row["tiling"].items())
        return shown + ("  (default)" if row["default"] else "")

    print(f"\n{name}: decode attention, one layer (KV GB/s; copy = device copy read+write)")
    print(f"{'batch':>6}{'us':>10}{'GB/s':>9}{'of copy':>9}  tiling")
    for r in tilings["decode"]:
        print(
            f"{r['batch_size']:>6}{r['us']:>10.1f}{r['gb_per_s']:>9.0f}"
            f"{r['fraction_of_copy']:>9.0%}  {tiling(r)}"
        )
    if "verify" in tilings:
        print(f"{name}: verify attention (a token + 4 drafts per sequence), one layer")
        print(f"{'batch':>6}{'us':>10}{'GB/s':>9}{'of copy':>9}  way (KV read once = GB/s)")
        for r in tilings["verify"]:
            print(
                f"{r['batch_size']:>6}{r['us']:>10.1f}{r['gb_per_s']:>9.0f}"
                f"{r['fraction_of_copy']:>9.0%}  {r['way']}"
            )
    print(f"{name}: prefill attention, one layer of one prompt (causal FLOP/s)")
    print(f"{'tokens':>6}{'us':>10}{'TFLOP/s':>9}{'of peak':>9}  tiling")
    for r in tilings["prefill"]:
        print(
            f"{r['tokens']:>6}{r['us']:>10.1f}{r['flop_per_s'] / 1e12:>9.1f}"
            f"{r['fraction_of_peak']:>9.0%}  {tiling(r)}"
        )


def print_model(name: str, model: dict[str, Any]) -> None:
    pdserve = model["pdserve"]
    print(f"\n{name}: decode (median step; roofline = (weights + KV read) / copy read+write)")
    print(f"{'batch':>6}{'context':>9}{'ms/step':>10}{'roofline':>10}{'ratio':>9}{'tok/s':>10}")
    for r in pdserve["decode"]:
        print(
            f"{r['batch_size']:>6}{r['context_len']:>9}{r['step_ms']:>10.2f}"
            f"{r['roofline_ms']:>10.3f}{r['ratio_to_roofline']:>9.2f}{r['tokens_per_s']:>10.0f}"
        )
    print(f"{name}: prefill (one prompt; ideal = model FLOPs / matmul peak)")
    print(f"{'tokens':>6}{'ms':>10}{'tok/s':>10}{'ideal ms':>10}{'of peak':>9}")
    for r in pdserve["prefill"]:
        print(
            f"{r['tokens']:>6}{r['ms']:>10.2f}{r['tokens_per_s']:>10.0f}"
            f"{r['ideal_ms']:>10.2f}{r['fraction_of_peak']:>9.0%}"
        )
    hf = model.get("transformers")
    if hf is not None:
        print_transformers(name, hf, pdserve)


def print_transformers(name: str, hf: dict[str, Any], pdserve: dict[str, Any]) -> None:
    generate = hf["generate"]
    batch_size = generate["batch_size"]
    rows = [r for r in pdserve["decode"] if r["batch_size"] == batch_size]
    ours = f"{rows[0]['tokens_per_s']:.0f}" if rows else "not run"
    print(
        f"{name}: batch-{batch_size} decode tok/s: pdserve {ours}, transformers generate "
        f"{generate['decode_tokens_per_s']:.0f} ({generate['decode_step_ms']:.1f} ms/step)"
    )
    batched = hf.get("generate_batch")
    if batched is None:
        return
    if not batched["ran"]:
        print(f"{name}: transformers generate_batch did not run: {batched['error']}")
        return
    rate = batched["decode_tokens_per_s"]
    shown = "n/a" if rate is None else f"{rate:.0f}"
    print(
        f"{name}: transformers generate_batch decode {shown} tok/s "
        f"({batched['generated_tokens']} tokens, complete: {batched['complete']})"
    )


def print_transfer(transfer: dict[str, Any]) -> None:
    print(
        f"\nKV transfer ({transfer['transport']}; payload GB/s, copy = same-size copy_; "
        "scatter = the receiver's copy into its blocks, other = the rest of the sender's call)"
    )
    print(
        f"{'tokens':>6}{'MiB':>8}{'GB/s':>9}{'copy':>9}{'ratio':>7}"
        f"{'scatter GB/s':>14}{'other ms':>10}"
    )
    for r in transfer["rows"]:
        scatter = r.get("scatter_gb_per_s")
        print(
            f"{r['tokens']:>6}{r['nbytes'] / MIB:>8.1f}{r['gb_per_s']:>9.2f}"
            f"{r['copy_gb_per_s']:>9.2f}{r['fraction_of_copy']:>7.0%}"
            f"{'n/a' if scatter is None else f'{scatter:.2f}':>14}"
            f"{r.get('outside_scatter_ms', float('nan')):>10.3f}"
        )


def print_quantized_gemm(name: str, rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{name}: one GEMM per path (floor = (weight + activation bytes) / copy read+write; "
        "x bf16 = time / bf16's)"
    )
    print(
        f"{'proj':>8}{'tokens':>7}  {'path':<16}{'us':>10}{'floor us':>10}{'of floor':>9}"
        f"{'x bf16':>8}{'TFLOP/s':>9}{'weight MiB':>11}  note"
    )
    for r in rows:
        case = f"{r['projection']:>8}{r['tokens']:>7}  {r['path']:<16}"
        if "error" in r:
            print(f"{case}  ERROR {r['error']}")
            continue
        note = "_scaled_mm" if r.get("scaled_mm") else ""
        note += "" if r.get("graphed") else (" " if note else "") + "not graphed"
        print(
            f"{case}{r['us']:>10.1f}{r['floor_us']:>10.1f}{r['fraction_of_floor']:>9.0%}"
            f"{r.get('ratio_to_bf16', float('nan')):>8.2f}{r['tflop_per_s']:>9.1f}"
            f"{r['weight_bytes'] / MIB:>11.2f}  {note}"
        )


def print_quantized_kv_attention(name: str, rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{name}: decode attention over each KV cache type, one layer (floor = KV bytes / "
        "copy read+write; x bf16 = time / the model dtype's cache's)"
    )
    print(
        f"{'batch':>6}{'context':>9}  {'cache':<10}{'us':>10}{'floor us':>10}{'of floor':>9}"
        f"{'x bf16':>8}{'GB/s':>8}"
    )
    for r in rows:
        case = f"{r['batch_size']:>6}{r['context_len']:>9}  {r['kv_cache_dtype']:<10}"
        if "error" in r:
            print(f"{case}  ERROR {r['error']}")
            continue
        print(
            f"{case}{r['us']:>10.1f}{r['floor_us']:>10.1f}{r['fraction_of_floor']:>9.0%}"
            f"{r.get('ratio_to_bf16', float('nan')):>8.2f}{r['gb_per_s']:>8.0f}"
        )


def print_targets(targets: list[dict[str, Any]]) -> None:
    if not targets:
        return  # a run of one section (``--only``) judges none
    print("\ntargets")
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        outcome = {True: "PASS", False: "FAIL", None: "n/a"}[t["passed"]]
        note = f"  ({t['note']})" if t["note"] else ""
        print(f"  {outcome:<5}{t['model']:>5}  {t['target']}: {value} (goal {t['goal']}){note}")
