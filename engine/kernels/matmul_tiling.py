"""How a Triton matmul kernel cuts its work into programs (the fused experts', the packed
integer GEMM's), and the check of a tiling a caller passes."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kernels.checks import require, require_power_of_two

MIN_DOT_DIM = 16  # tl.dot wants every dimension >= 16


@dataclass(frozen=True, slots=True)
class MatmulTiling:
    """A matmul kernel's tiles; each kernel's ``default_tiling`` is what the engine runs."""

    block_m: int  # rows per program (a power of two >= 16)
    block_n: int = 64  # output columns per program (a power of two >= 16)
    block_k: int = 64  # inputs per step of a program's loop (a power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelined loads in flight

    def launch_options(self) -> dict[str, int]:
        """The tiles as a kernel launch takes them: its BLOCK_M / BLOCK_N / BLOCK_K constants,
        warps and stages."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


def check_tiling(tiling: MatmulTiling) -> None:
    """Raise ValueError naming the field of ``tiling`` no kernel can run."""
    require_power_of_two("tiling.block_m", tiling.block_m, MIN_DOT_DIM)
    require_power_of_two("tiling.block_n", tiling.block_n, MIN_DOT_DIM)
    require_power_of_two("tiling.block_k", tiling.block_k, MIN_DOT_DIM)
    require_power_of_two("tiling.num_warps", tiling.num_warps, 1)
    require(tiling.num_stages >= 1, f"tiling.num_stages must be >= 1, got {tiling.num_stages}")


# 8-bit operands (float8 e4m3, int8) take a tensor-core step of 32 inputs (an mma's k)
MIN_DOT_K_8BIT = 32


def check_tiling_8bit(tiling: MatmulTiling) -> None:
    """``check_tiling``, and K steps of at least ``MIN_DOT_K_8BIT`` (for 8-bit operands)."""
    check_tiling(tiling)
    require_power_of_two("tiling.block_k", tiling.block_k, MIN_DOT_K_8BIT)
