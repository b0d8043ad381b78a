"""Per-sample seeds (pure Python, so the scheduler can derive them without torch)."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """Seed for the ``index``-th of ``n`` parallel samples; index 0 keeps ``seed`` itself.

    Other indices mix (seed, index) with SplitMix64, so siblings get unrelated streams and the
    result is the same in every process (no Python ``hash``).
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if index == 0:
        return seed
    z = ((seed & MASK64) + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: a valid non-negative seed everywhere
