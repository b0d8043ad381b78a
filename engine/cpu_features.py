"""What the CPU at hand computes natively, read from ``/proc/cpuinfo`` (no torch): whether it has
bfloat16 dot products (x86's AVX512-BF16 or AMX-BF16, Arm's BF16). Without them a bfloat16
matmul widens its operands to float32 first, and a float16 one on a CPU has no fast path at
all here (the demo model's offline workload took 55.7 s of CPU in float16 against 5.9 in
bfloat16 on the 2-core Xeon, session 71): so ``dtype="auto"`` runs a float16 checkpoint on a
CPU in bfloat16 where the CPU has them, in float32 where not (engine_config.py)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags (x86's ``flags``, Arm's ``Features``); none where the file is
    missing (not Linux)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def has_native_bfloat16(flags: Collection[str]) -> bool:
    """Whether CPU ``flags`` name native bfloat16 dot products."""
    return not NATIVE_BFLOAT16_FLAGS.isdisjoint(flags)
