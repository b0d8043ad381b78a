"""pdserve on one model: sizing the engine for a preset, then its decode steps and prefills.

``engine.LLM`` with dummy weights from a written config; decode steps are timed at each batch
size once all prompts are prefilled, prefills one prompt at a time. Rooflines come from the
model's shapes and the measured ceilings (see the package docstring).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.shapes import BLOCK_SIZE, DTYPE_BYTES, ModelSpec, Preset, random_prompt
from bench.gpu.timing import log, peak_flop_per_s, read_bytes_per_s, synchronize, timed_wall

MEMORY_HEADROOM_BYTES = 6 << 30  # activations, logits and the allocator's slack, on CUDA


def step_token_budget(preset: Preset) -> int:
    """max_num_batched_tokens: the longest prefill runs as one step."""
    return max(*preset.prefill_lens, 2048)


def decode_len_bound(preset: Preset, batch_size: int) -> int:
    """Tokens a decoding request can reach: prompt, warm-up and timed steps, and the tokens
    the earliest prompts decode while the scheduler still prefills the rest of the batch."""
    budget = step_token_budget(preset)
    prefill_steps = -(-batch_size * preset.context_len // max(budget - batch_size, budget // 2))
    steps = preset.num_warmup_steps + preset.num_decode_steps + prefill_steps + 4
    return preset.context_len + steps


def blocks_needed(preset: Preset, batch_sizes: list[int]) -> int:
    decode = max(
        (b * -(-decode_len_bound(preset, b) // BLOCK_SIZE) for b in batch_sizes), default=0
    )
    prefill = -(-(max(preset.prefill_lens) + 2) // BLOCK_SIZE)
    return max(decode, prefill) + 64


def max_model_len(preset: Preset) -> int:
    decode_len = max(decode_len_bound(preset, b) for b in (*preset.batch_sizes, 1))
    return max(max(preset.prefill_lens), decode_len) + 16


def batch_sizes_that_fit(
    spec: ModelSpec, device: torch.device, dtype: str, preset: Preset
) -> list[int]:
    """The preset's batch sizes whose KV fits beside the weights (all of them off CUDA)."""
    sizes = sorted(preset.batch_sizes)
    if device.type != "cuda":
        return sizes
    free, _ = torch.cuda.mem_get_info(device)
    budget = free - spec.num_params * DTYPE_BYTES[dtype] - MEMORY_HEADROOM_BYTES
    block_bytes = BLOCK_SIZE * spec.kv_bytes_per_token(dtype)
    while sizes and blocks_needed(preset, sizes) * block_bytes > budget:
        log(f"{spec.name}: batch {sizes.pop()} does not fit in GPU memory; skipped")
    return sizes


def build_llm(
    model_dir: Path, device: torch.device, dtype: str, preset: Preset, batch_sizes: list[int]
) -> Any:
    from engine import LLM

    return LLM(
        str(model_dir),
        load_format="dummy",
        dtype=dtype,
        device=str(device),
        skip_tokenizer_init=True,
        num_kv_blocks=blocks_needed(preset, batch_sizes),
        max_model_len=max_model_len(preset),
        max_num_seqs=max(batch_sizes + [preset.hf_batch_size, 1]),
        max_num_batched_tokens=step_token_budget(preset),
        attention_backend="auto" if device.type == "cuda" else "torch",
        linear_backend="torch",  # what "auto" picks on CUDA; on CPU it would pick oneDNN
    )


def prefill_all(engine: Any, device: torch.device) -> tuple[float, int]:
    """Step until every request has its whole prompt computed; (seconds, steps)."""
    seconds, num_steps = 0.0, 0
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        elapsed, _ = timed_wall(engine.step, device)
        seconds, num_steps = seconds + elapsed, num_steps + 1
    return seconds, num_steps


def measure_decode(
    engine: Any, spec: ModelSpec, dtype: str, batch_size: int, preset: Preset, read_bw: float
) -> dict[str, Any]:
    """Median decode-only step of ``batch_size`` requests at the preset's context."""
    from engine import SamplingParams

    device = engine.device
    rng = random.Random(f"decode-{batch_size}")
    max_tokens = decode_len_bound(preset, batch_size) - preset.context_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [f"decode-{batch_size}-{i}" for i in range(batch_size)]
    for request_id in request_ids:
        prompt = random_prompt(rng, preset.context_len, spec.vocab_size)
        engine.add_request(request_id, prompt, params)
    prefill_s, prefill_steps = prefill_all(engine, device)
    for _ in range(preset.num_warmup_steps):
        engine.step()
    samples, kv_tokens = [], []
    for _ in range(preset.num_decode_steps):
        kv_tokens.append(sum(seq.num_tokens for seq in engine.scheduler.running))
        elapsed, step = timed_wall(engine.step, device)
        if len(step.new_tokens) != batch_size or step.finished:
            raise RuntimeError(f"step was not a pure batch-{batch_size} decode")
        samples.append(elapsed)
    for request_id in request_ids:
        engine.abort_request(request_id)
    step_s = statistics.median(samples)
    roofline = decode_roofline(spec, dtype, statistics.mean(kv_tokens), read_bw)
    return {
        "batch_size": batch_size,
        "context_len": preset.context_len,
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "step_ms": step_s * 1e3,
        "step_ms_min": min(samples) * 1e3,
        "tokens_per_s": batch_size / step_s,
        "mean_attended_tokens": statistics.mean(kv_tokens) / batch_size,
        **roofline,
        "ratio_to_roofline": step_s * 1e3 / roofline["roofline_ms"],
    }


def decode_roofline(
    spec: ModelSpec, dtype: str, kv_tokens: float, read_bw: float
) -> dict[str, Any]:
    """What a decode step reads (weights, and the KV of ``kv_tokens`` positions in all), and
    that over the read bandwidth."""
    weight_bytes = spec.decode_weight_bytes(dtype)
    kv_bytes = int(kv_tokens * spec.kv_bytes_per_token(dtype))
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "roofline_ms": (weight_bytes + kv_bytes) / read_bw * 1e3,
    }


def measure_prefill(
    engine: Any,
    spec: ModelSpec,
    num_tokens: int,
    preset: Preset,
    peak_flops: float,
    label: str = "timed",
) -> dict[str, Any]:
    """One prompt of ``num_tokens`` alone, to its first token; median after one warm-up.

    Prompts are random per ``label``, so no run hits the prefix cache of another.
    """
    from engine import SamplingParams

    device = engine.device
    rng = random.Random(f"prefill-{num_tokens}-{label}")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples, num_steps = [], 0
    for rep in range(preset.num_prefill_reps + 1):
        prompt = random_prompt(rng, num_tokens, spec.vocab_size)
        engine.add_request(f"prefill-{num_tokens}-{label}-{rep}", prompt, params)
        num_steps = 0
        synchronize(device)
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
        synchronize(device)
        samples.append(time.perf_counter() - started)
    seconds = statistics.median(samples[1:])
    flops = spec.prefill_flops(num_tokens)
    ideal_s = sum(flops.values()) / peak_flops
    return {
        "tokens": num_tokens,
        "steps": num_steps,
        "ms": seconds * 1e3,
        "tokens_per_s": num_tokens / seconds,
        "flops": flops,
        "ideal_ms": ideal_s * 1e3,
        "ideal_linear_only_ms": 2 * spec.linear_params * num_tokens / peak_flops * 1e3,
        "fraction_of_peak": ideal_s / seconds,
    }


def run_pdserve(
    spec: ModelSpec,
    model_dir: Path,
    device: torch.device,
    dtype: str,
    preset: Preset,
    ceilings: dict[str, Any],
) -> dict[str, Any]:
    batch_sizes = batch_sizes_that_fit(spec, device, dtype, preset)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    llm = build_llm(model_dir, device, dtype, preset, batch_sizes)
    build_s = time.perf_counter() - started
    log(f"{spec.name}: pdserve built in {build_s:.1f} s")
    engine = llm.engine
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    read_bw, peak_flops = read_bytes_per_s(ceilings), peak_flop_per_s(ceilings)
    measure_prefill(engine, spec, min(preset.prefill_lens), preset, peak_flops, "warm-up")
    decode = []
    for batch_size in batch_sizes:
        decode.append(measure_decode(engine, spec, dtype, batch_size, preset, read_bw))
        row = decode[-1]
        log(
            f"{spec.name}: decode batch {batch_size}: {row['step_ms']:.2f} ms/step "
            f"(roofline {row['roofline_ms']:.2f} ms)"
        )
    prefill = []
    for num_tokens in preset.prefill_lens:
        prefill.append(measure_prefill(engine, spec, num_tokens, preset, peak_flops))
        log(f"{spec.name}: prefill {num_tokens}: {prefill[-1]['tokens_per_s']:.0f} tok/s")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "build_s": build_s,
        "param_bytes": param_bytes,
        "num_kv_blocks": engine.block_manager.pool.num_blocks,
        "peak_memory_bytes": peak,
        "decode": decode,
        "prefill": prefill,
    }
