"""MXFP4 weights dequantized into float32 by the C kernel in ``mxfp4.c`` (CPU): the same bits
as the torch path of engine/quantization/mxfp4_experts.py, several times faster (an expert's
weights are dequantized for every step it has tokens in).

Callers ask ``usable(blocks)`` first and keep the torch path otherwise (a GPU, a machine
without a C compiler).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine.kernels.cpu.build import INT64, POINTER, KernelUnavailableError, function

logger = logging.getLogger(__name__)


@functools.cache
def _kernel() -> Any | None:
    try:
        return function("mxfp4", "mxfp4_dequantize_f32", None, [POINTER, POINTER, POINTER, INT64])
    except KernelUnavailableError as error:
        logger.warning("MXFP4 dequantization: torch on CPU (%s)", error)
        return None


def usable(blocks: torch.Tensor) -> bool:
    """The kernel takes ``blocks``: on a CPU, on a machine that could build it."""
    return blocks.device.type == "cpu" and _kernel() is not None


def dequantize_f32(
    blocks: torch.Tensor,  # [..., out, in / 32, 16] uint8
    scales: torch.Tensor,  # [..., out, in / 32] uint8
) -> torch.Tensor:  # [..., out, in] float32
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=torch.float32)
    kernel = _kernel()
    assert kernel is not None, "ask usable() first"
    kernel(blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), scales.numel())
    return out
