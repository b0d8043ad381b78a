"""MXFP4, the format OpenAI publishes gpt-oss's routed experts in (``quant_method: mxfp4``).

Each weight is a 4-bit e2m1 float (a sign bit and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6), two to
a byte, the even input in the low nibble; each run of 32 inputs of an output row shares a
power-of-two scale, one e8m0 byte (the exponent plus 127). A layer's experts are stacked as
the checkpoint stores them, output rows first (the transpose of the ``x @ W`` layout gpt-oss's
float experts hold):
  ``<proj>_blocks``  [E, out, in / 32, 16] uint8
  ``<proj>_scales``  [E, out, in / 32] uint8
gate_up's output rows are gate and up interleaved (2j, 2j + 1), as its float tensor's columns.
Dequantizing gives exactly what transformers' ``convert_moe_packed_tensors`` gives (a table
lookup in the target dtype, then ``ldexp`` by the exponent), so the engine's float weights
are its, bit for bit. Only one expert's weights are dequantized at a time, for the step it
has tokens in (``Mxfp4ClampedSwigluExperts`` in engine/models/moe.py); the whole layer stays
4.25 bits a weight. ``quantize_mxfp4`` writes the format from float weights (what the tests'
and the benchmark's checkpoints are made with: no tool writes MXFP4 on a CPU).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kernels.cpu import mxfp4 as cpu_mxfp4

GROUP = 32  # inputs sharing one scale
BYTES_PER_GROUP = GROUP // 2
SCALE_BIAS = 127  # an e8m0 scale byte is the exponent plus this
# the e2m1 value of each nibble: bit 3 the sign, bits 0-2 the magnitude's index
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., out, in / 32, 16] uint8
    scales: torch.Tensor,  # [..., out, in / 32] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., out, in] in dtype
    """Each weight's e2m1 value times 2 ** (its group's scale byte - 127), rounded once to
    ``dtype``: the same bits as transformers' ``ldexp`` (which multiplies exactly and rounds).
    Computed in float32, where every product is exact but where it overflows, then cast: on a
    CPU by the C kernel (engine/kernels/cpu/mxfp4.c), else by looking up each byte's two values
    and each scale's power of two. The byte 255's 2^128 is no float32: its runs are multiplied
    by 2^127 and then by 2, which overflows where the exact product would round to infinity."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BYTES_PER_GROUP:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
            f"blocks must be [..., out, in / {GROUP}, {BYTES_PER_GROUP}] over the scales' shape"
        )
    if cpu_mxfp4.usable(blocks):
        weights = cpu_mxfp4.dequantize_f32(blocks, scales)
    else:
        pairs, powers, doublings = _tables(blocks.device)
        values = F.embedding(blocks.int(), pairs).view(*scales.shape, GROUP)
        exponents = scales.int()
        weights = values * F.embedding(exponents, powers) * F.embedding(exponents, doublings)
        weights = weights.flatten(-2)
    return weights if dtype == torch.float32 else weights.to(dtype)


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In float32: a byte's two e2m1 values (low nibble first) [256, 2]; a scale byte's power
    of two [256, 1], the byte 255's 2^127; and what to multiply by next [256, 1], 2 for the
    byte 255, else 1."""
    values = torch.tensor(E2M1_VALUES, device=device)
    pairs = torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1)
    exponents = (torch.arange(256, device=device) - SCALE_BIAS).clamp(max=127)
    powers = torch.ldexp(torch.ones(256, device=device), exponents)
    doublings = torch.ones(256, device=device)
    doublings[255] = 2.0
    return pairs, powers.unsqueeze(-1), doublings.unsqueeze(-1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., out, in] as MXFP4: blocks [..., out, in / 32, 16] and scales
    [..., out, in / 32] uint8. Each run of 32 inputs takes the smallest power of two that
    brings its largest magnitude to 6 or under, each weight the nearest e2m1 value (the lower
    one on a tie)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    groups = weight.float().reshape(*weight.shape[:-1], -1, GROUP)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    nibbles = (index | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)


def check_mxfp4_width(name: str, width: int) -> None:
    """Raises ValueError unless ``width`` inputs (this rank's) fill whole groups of 32."""
    if width % GROUP:
        raise ValueError(
            f"{name} {width} must be a multiple of {GROUP}: MXFP4 shares a scale over each run "
            f"of {GROUP} inputs (quantization_config quant_method mxfp4); a tensor-parallel "
            "rank's columns must fill whole runs (or deal the experts out whole: expert "
            "parallelism)"
        )
