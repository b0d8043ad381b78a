"""The KV-transfer section: cuda_ipc (shm off CUDA) hand-offs beside a same-size device copy."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bench.gpu.shapes import BLOCK_SIZE, MIB, ModelSpec, Preset
from bench.gpu.timing import free_memory, log, measure_copy


def measure_transfer(
    spec: ModelSpec, device: torch.device, dtype: str, preset: Preset
) -> dict[str, Any]:
    """cuda_ipc (shm on CPU) hand-offs of the preset's prompt sizes, via bench.kv_transfer."""
    from bench import kv_transfer as kvb
    from kv_transfer import KVCacheLayout

    transport = "cuda_ipc" if device.type == "cuda" else "shm"
    where = "cuda:0" if device.type == "cuda" else "cpu"
    layout = KVCacheLayout(dtype, BLOCK_SIZE, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    tokens = sorted(preset.transfer_tokens)
    sizes_mb = [-(-t // BLOCK_SIZE) * layout.block_nbytes / MIB for t in tokens]
    num_blocks = int(-(-tokens[-1] // BLOCK_SIZE) * 1.25) + 8
    jobs = kvb.make_jobs(layout, sizes_mb, preset.num_reps, num_blocks, seed=2)
    session = kvb.Session("gpu", layout, num_blocks, jobs)
    log(f"{transport} transfers of {tokens} tokens ({spec.name} layout) ...")
    (pairs,) = kvb.run_transport(transport, where, where, [session], None, torch.get_num_threads())
    rows = kvb.summarize_sweep(session, pairs, where, preset.num_reps)
    for row, num_tokens in zip(rows, tokens):
        copy = measure_copy(torch.device(where), row["nbytes"], preset.num_reps)
        row.update(tokens=num_tokens, copy_gb_per_s=copy["copied_gb_per_s"])
        row["fraction_of_copy"] = row["gb_per_s"] / row["copy_gb_per_s"]
    free_memory(device)
    return {"transport": transport, "layout": dataclasses.asdict(layout), "rows": rows}
