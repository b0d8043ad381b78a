"""Where the loader puts each checkpoint tensor: the slice of it a rank reads and the rows of a
parameter it lands in (``Target``), and for a quantized layer's tensors (packed integers,
their scales and zero points, 8-bit weights' scales, FP8 blocks' scales) where each lands in
its own units, from where its float weight's slice would (``quantized_target``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine.quantization.awq_gptq import is_awq_or_gptq, to_layer_rows
from engine.quantization.config import (
    Fp8BlockWeights,
    PackedIntWeights,
    W8A8Weights,
    WeightQuantization,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor's slice lands: rows [row_offset, row_offset + num_rows) of
    param, filled from the tensor's ``rows`` (and ``cols``); the rest of those rows is zeros."""

    param: torch.Tensor  # the parameter a checkpoint tensor lands in
    row_offset: int  # first row of its slice (fused projections stack along dim 0)
    num_rows: int  # rows of param this tensor owns on this rank
    full_shape: tuple[int, ...]  # the checkpoint tensor's shape
    rows: range  # its rows this rank reads (dim 0); fewer than num_rows past the vocabulary
    cols: range | None  # its columns this rank reads (dim 1); None: all
    depth: range | None = None  # its range of dim 2 (stacked experts); None: all
    # turns the slice read into param's rows (a quantized layout stored transposed); None: as is
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None

    def is_whole(self) -> bool:
        """Whether this rank reads the entire tensor."""
        whole_cols = self.cols is None or self.cols == range(self.full_shape[1])
        whole_depth = self.depth is None or self.depth == range(self.full_shape[2])
        return self.rows == range(self.full_shape[0]) and whole_cols and whole_depth

    def index(self) -> tuple[slice, ...]:
        """The slice of the checkpoint tensor to read."""
        ranges = (self.rows, self.cols, self.depth)
        last = max(dim for dim, kept in enumerate(ranges) if kept is not None)
        return tuple(
            slice(None) if kept is None else slice(kept.start, kept.stop)
            for kept in ranges[: last + 1]
        )


def quantized_target(
    leaf: str, target: Target, param: torch.Tensor, weights: WeightQuantization
) -> Target:
    """Where a quantized layer's ``leaf`` tensor lands, from ``target``, where its float
    weight [out, in] would."""
    if isinstance(weights, PackedIntWeights):
        return _packed_int_target(leaf, target, param, weights)
    if leaf == "weight":  # 8 bits, the float weight's shape
        return dataclasses.replace(target, param=param)
    if isinstance(weights, W8A8Weights):
        return _w8a8_scale_target(leaf, target, param, weights)
    assert isinstance(weights, Fp8BlockWeights)  # (MXFP4 experts are stacked: not a layer's)
    return _fp8_block_scale_target(target, param, weights)


def _w8a8_scale_target(
    leaf: str, target: Target, param: torch.Tensor, weights: W8A8Weights
) -> Target:
    """Where an 8-bit layer's scale lands: a scale per output row ("channel" weight scales)
    as the weight's rows, on every rank of a row-parallel layer; a checkpoint tensor's one scale
    (per-tensor weight scales, static input scales: [1]) repeated over the rows its tensor
    fills here (a fused part's, or the whole layer's), on every rank."""
    if leaf == "weight_scale" and weights.weight_strategy == "channel":
        out_features = target.full_shape[0]
        return dataclasses.replace(target, param=param, full_shape=(out_features, 1), cols=None)
    num_rows = target.num_rows

    def repeat(scale: torch.Tensor) -> torch.Tensor:  # [1] -> [num_rows, 1]
        return scale.reshape(1, 1).expand(num_rows, 1)

    return Target(param, target.row_offset, num_rows, (1,), range(1), None, convert=repeat)


def _fp8_block_scale_target(
    target: Target, param: torch.Tensor, weights: Fp8BlockWeights
) -> Target:
    """Where an FP8 layer's block scales land: its float weight's rows and columns in blocks
    (a slice must start on a block; only a tensor's last block may be short)."""
    out_features, in_features = target.full_shape
    rows, cols = weights.block_rows, weights.block_cols
    own = range(target.row_offset, target.row_offset + target.num_rows)
    own_blocks = _in_blocks(own, rows, target.param.shape[0])
    return Target(
        param,
        own_blocks.start,
        len(own_blocks),
        (-(-out_features // rows), -(-in_features // cols)),
        _in_blocks(target.rows, rows, out_features),
        None if target.cols is None else _in_blocks(target.cols, cols, in_features),
    )


def _in_blocks(indices: range, block: int, total: int) -> range:
    """``indices`` of ``total`` counted in blocks of ``block``: they must start on a block and
    end on one or at ``total`` (a tensor's last block may be short)."""
    if indices.start % block or (indices.stop % block and indices.stop != total):
        raise ValueError(
            f"rows or columns {indices.start}..{indices.stop} of {total} do not fall on whole "
            f"blocks of {block} (quantization_config weight_block_size): a fused projection's "
            "parts and a tensor-parallel rank's slice must"
        )
    return range(indices.start // block, -(-indices.stop // block))


def _packed_int_target(
    leaf: str, target: Target, param: torch.Tensor, weights: PackedIntWeights
) -> Target:
    """Where a packed integer layer's ``leaf`` tensor lands, from ``target``, where its float
    weight [out, in] would: rows are output features (the zero points' packed, a word per
    ``pack_factor`` rows), columns inputs (packed into words, or one per group)."""
    if is_awq_or_gptq(weights):
        return _awq_gptq_target(leaf, target, param, weights)
    out_features, in_features = target.full_shape
    group = weights.group_size or in_features
    cols = target.cols
    if leaf == "weight_packed":
        pack = weights.pack_factor
        return dataclasses.replace(
            target,
            param=param,
            full_shape=(out_features, in_features // pack),
            cols=None if cols is None else in_units(cols, pack, "num_bits"),
        )
    # a rank's input columns in groups; with one group a row (per channel), that column on
    # every rank
    per_channel = weights.group_size is None
    groups = None if cols is None or per_channel else in_units(cols, group, "group_size")
    if leaf == "weight_scale":
        return dataclasses.replace(
            target, param=param, full_shape=(out_features, in_features // group), cols=groups
        )
    pack = weights.pack_factor  # weight_zero_point: packed along the rows
    return Target(
        param,
        in_units(
            range(target.row_offset, target.row_offset + target.num_rows), pack, "num_bits"
        ).start,
        target.num_rows // pack,
        (out_features // pack, in_features // group),
        in_units(target.rows, pack, "num_bits"),
        groups,
    )


def _awq_gptq_target(
    leaf: str, target: Target, param: torch.Tensor, weights: PackedIntWeights
) -> Target:
    """Where an AWQ or GPTQ layer's ``leaf`` tensor lands, from ``target``, where its float
    weight [out, in] would. Both formats store [inputs, outputs]: the rows read are inputs (in
    GPTQ's qweight words of them; in scales and zero points groups), the columns outputs (words
    of them in AWQ's qweight and in qzeros); each slice read is converted into param's rows,
    our layout (``to_layer_rows``). GPTQ's g_idx lands whole on each rank, its groups counted
    from the rank's first."""
    out_features, in_features = target.full_shape
    pack, group = weights.pack_factor, weights.group_size or in_features
    inputs = range(in_features) if target.cols is None else target.cols
    if weights.act_order and inputs != range(in_features):
        raise ValueError(
            "quantization_config.desc_act true (GPTQ's activation order) runs on one "
            "tensor-parallel rank only: a row-parallel rank's inputs belong to any of the "
            "layer's groups (tensor_parallel_size 1)"
        )
    per_channel = weights.group_size is None
    groups = range(1) if per_channel else in_units(inputs, group, "group_size")
    if leaf == "g_idx":  # each fused part's, into the one param: they must agree
        convert = _same_groups(param, groups.start)
        return Target(param, 0, len(inputs), (in_features,), inputs, None, convert=convert)
    outputs, output_words = target.rows, in_units(target.rows, pack, "num_bits")
    convert = to_layer_rows(leaf, weights)
    if leaf == "weight_zero_point":  # [groups, out / pack], to our [out / pack, groups]
        own = range(target.row_offset, target.row_offset + target.num_rows)
        own_words = in_units(own, pack, "num_bits")
        shape = (in_features // group, out_features // pack)
        return Target(
            param, own_words.start, len(own_words), shape, groups, output_words, convert=convert
        )
    if leaf == "weight_scale":  # [groups, out]
        shape, rows, cols = (in_features // group, out_features), groups, outputs
    elif weights.method == "gptq":  # qweight [in / pack, out]
        input_words = in_units(inputs, pack, "num_bits")
        shape, rows, cols = (in_features // pack, out_features), input_words, outputs
    else:  # AWQ's qweight [in, out / pack]
        shape, rows, cols = (in_features, out_features // pack), inputs, output_words
    return dataclasses.replace(
        target, param=param, full_shape=shape, rows=rows, cols=cols, convert=convert
    )


def _same_groups(g_idx: torch.Tensor, first_group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A GPTQ g_idx slice read, its groups counted from this rank's ``first_group``; raises
    where a fused projection's part read before (``g_idx`` no longer -1) gave other groups."""

    def convert(read: torch.Tensor) -> torch.Tensor:
        groups = read.to(g_idx.device) - first_group
        if bool((g_idx >= 0).any()) and not torch.equal(g_idx, groups):
            raise ValueError(
                "the g_idx of a fused projection's parts (q, k, v or gate, up) differ: their "
                "inputs in activation order (quantization_config.desc_act) must be the same"
            )
        return groups

    return convert


def in_units(indices: range, unit: int, field: str) -> range:
    """``indices`` counted in blocks of ``unit``; raises where a block would be split (a
    tensor-parallel rank's slice that cuts a packed word or a quantization group)."""
    if indices.start % unit or indices.stop % unit:
        raise ValueError(
            f"a tensor-parallel slice {indices.start}..{indices.stop} cuts a block of {unit} "
            f"(quantization_config {field}); choose a tensor_parallel_size that splits the "
            "layers at whole blocks"
        )
    return range(indices.start // unit, indices.stop // unit)
