"""AWQ's and GPTQ's packed tensors, as published, converted into compressed-tensors' layout
(engine/quantization/packed_linear.py) slice by slice as the loader reads them, exactly: the
same integers, zero points and scales, so one CPU path and one GPU kernel serve every format.

Both formats store a layer transposed, [inputs, outputs] (docs/quantized-checkpoints.md):
  AWQ (GEMM)  qweight [in, out / 8] int32: unsigned 4-bit integers packed along the outputs,
                nibble k of word j holding output 8 j + ``AWQ_ORDER[k]``
              qzeros  [in / group, out / 8] int32: unsigned zero points, packed the same way
              scales  [in / group, out] float16
  GPTQ        qweight [in / pack, out] int32: unsigned integers packed along the inputs, in
                order, lowest bits first
              qzeros  [in / group, out / pack] int32: unsigned zero points packed along the
                outputs; the "gptq" (v1) format stores each word as the zero points' word minus
                one in every field (GPTQModel writes it so, and adds it back as it reads)
              scales  [in / group, out] float16
              g_idx   [in] int32: each input's group (``i // group`` unless in activation order)
Both dequantize (q - zero) * scale. Compressed-tensors holds the signed q - 2^(bits - 1) and
zero - 2^(bits - 1) and packs each offset back by 2^(bits - 1): the same unsigned fields, so
converting moves fields between words and never changes one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.quantization.config import PackedIntWeights, WeightQuantization
from engine.quantization.packed_linear import pack_int32, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of AWQ's word j: output 8 j + AWQ_ORDER[k]
_AWQ_COLUMN_NIBBLES = [AWQ_ORDER.index(column) for column in range(8)]  # column -> its nibble

# our tensor -> its name in an AWQ or GPTQ checkpoint
_PUBLISHED_NAMES = {
    "weight_packed": "qweight",
    "weight_scale": "scales",
    "weight_zero_point": "qzeros",
    "g_idx": "g_idx",
}

Convert = Callable[[torch.Tensor], torch.Tensor]


def is_awq_or_gptq(weights: WeightQuantization) -> bool:
    return isinstance(weights, PackedIntWeights) and weights.method in ("awq", "gptq")


def checkpoint_leaf(leaf: str, weights: WeightQuantization) -> str:
    """The name a quantized layer's tensor ``leaf`` has in the checkpoint."""
    return _PUBLISHED_NAMES[leaf] if is_awq_or_gptq(weights) else leaf


def to_layer_rows(leaf: str, weights: PackedIntWeights) -> Convert:
    """How a slice of the checkpoint tensor stored for ``leaf`` becomes rows of our ``leaf``:
    [inputs (or their words, or groups), outputs (or their words)] -> [outputs (or their
    words), inputs (or their words, or groups)]."""
    bits = weights.num_bits
    if leaf == "weight_scale":
        return _transposed
    if weights.method == "awq":
        if leaf == "weight_packed":
            return _awq_weight_rows
        return lambda qzeros: pack_int32(_awq_columns(qzeros), bits).t()
    if leaf == "weight_packed":
        return _transposed
    if weights.zeros_minus_one:
        return lambda qzeros: _plus_one_in_every_field(qzeros, bits).t()
    return _transposed


def _transposed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.t()


_INPUTS_PER_PASS = 1024  # AWQ qweight rows unpacked at a time (a multiple of 8)


def _awq_weight_rows(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ's qweight [in, out / 8] as our rows [out, in / 8], converted a slice of inputs at a
    time (the integers unpacked in int64 take 16 times the words' bytes)."""
    return torch.cat(
        [
            pack_int32(_awq_columns(qweight[start : start + _INPUTS_PER_PASS]).t(), 4)
            for start in range(0, qweight.shape[0], _INPUTS_PER_PASS)
        ],
        dim=1,
    )


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's 4-bit words [rows, n] unpacked into their unsigned integers [rows, 8 n], columns in
    order."""
    nibbles = unpack_int32(words, 4, words.shape[1] * 8) + 8  # [rows, 8 n], nibble order
    by_word = nibbles.reshape(words.shape[0], words.shape[1], 8)
    return by_word[:, :, _AWQ_COLUMN_NIBBLES].reshape(words.shape[0], -1)


def _plus_one_in_every_field(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """GPTQ v1 zero-point words back to the zero points': one added in every field, to the
    word as one integer (modulo 2^32), as GPTQModel reads them. It wrote the zero points' word
    minus one in every field the same way, a zero point of 0 borrowing from the next field;
    adding it back carries there again."""
    ones = sum(1 << shift for shift in range(0, 32, num_bits))
    total = (words.to(torch.int64) + ones) & 0xFFFFFFFF
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)
