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
4.25 bits a weight.
"""

from __future__ import annotations

import torch

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
    """Each weight's e2m1 value in ``dtype`` times 2 ** (its group's scale byte - 127)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BYTES_PER_GROUP:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
            f"blocks must be [..., out, in / {GROUP}, {BYTES_PER_GROUP}] over the scales' shape"
        )
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    values = torch.empty(*blocks.shape[:-1], GROUP, dtype=dtype, device=blocks.device)
    values[..., 0::2] = table[(blocks & 0x0F).int()]
    values[..., 1::2] = table[(blocks >> 4).int()]
    exponents = scales.int().sub_(SCALE_BIAS).unsqueeze(-1)
    torch.ldexp(values, exponents, out=values)
    return values.flatten(-2)


def check_mxfp4_width(name: str, width: int) -> None:
    """Raises ValueError unless ``width`` inputs (this rank's) fill whole groups of 32."""
    if width % GROUP:
        raise ValueError(
            f"{name} {width} must be a multiple of {GROUP}: MXFP4 shares a scale over each run "
            f"of {GROUP} inputs (quantization_config quant_method mxfp4); a tensor-parallel "
            "rank's columns must fill whole runs (or deal the experts out whole: expert "
            "parallelism)"
        )
