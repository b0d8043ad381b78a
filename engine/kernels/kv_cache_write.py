"""Triton kernel: scatter new tokens' K/V into their slots of one layer's paged KV cache.

``kv_cache_layer[0].view(-1, num_kv_heads, head_dim)[slot_mapping[i]] = key[i]`` and the same
for value into ``kv_cache_layer[1]``, for every token ``i`` whose slot is >= 0. A negative slot
marks a padding token (a batch padded to a captured size, as vLLM pads): its K/V are dropped.

Into a quantized cache (float8 e4m3 or int8 elements) each value is stored as
engine/kv_cache/kv_quantization.py's ``quantize_kv`` stores it, to the bit: divided by its
head's scale in float32 (IEEE division), then clamped to +-448 and rounded to the nearest e4m3
value, ties to even, or rounded to the nearest integer, ties to even, and clamped to +-127. The
rounding is done in integer and float32 arithmetic, not by Triton's casts: its interpreter's
float32 -> float8e4nv cast neither rounds ties to even nor handles subnormals and saturation as
the GPU does, and no round-half-even intrinsic reaches both it and the GPU. A NaN is stored as
torch stores it: float8 NaN (0x7f, with its sign), int8 0.

Programs: one per token (grid ``(num_tokens,)``); each moves the token's whole
``[num_kv_heads, head_dim]`` tile of K and of V, padded to powers of two and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    is_quantized_cache,
    require,
    require_kv_cache_layer,
    require_kv_scales,
    require_same_device,
)

# float32 x + 1.5 * 2^23 has no fraction bits left for |x| <= 2^22: the addition rounds x to an
# integer, half to even
_ROUND_TO_INTEGER: tl.constexpr = tl.constexpr(12582912.0)
# float32 x + 2^14 keeps multiples of 2^-9 (its ulp), e4m3's subnormal step: for |x| < 2^-6 the
# addition rounds x to an e4m3 subnormal, half to even; the sum's bits less 2^14's are its code
_E4M3_SUBNORMAL_ROUNDER: tl.constexpr = tl.constexpr(16384.0)
_E4M3_SUBNORMAL_ROUNDER_BITS: tl.constexpr = tl.constexpr(0x46800000)
_E4M3_MIN_NORMAL_BITS: tl.constexpr = tl.constexpr(121 << 23)  # 2^-6 in float32


@triton.jit
def to_float8e4nv(scaled):
    """float32 ``scaled`` clamped to +-448 and rounded to the nearest e4m3 value, ties to even
    (NaN to NaN, 0x7f with its sign)."""
    clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    sign = (scaled.to(tl.int32, bitcast=True) >> 24) & 0x80
    magnitude = clamped.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    # normal (>= 2^-6): drop the 20 mantissa bits e4m3 lacks, rounding to nearest even (a carry
    # moves into the exponent), then rebias the exponent from float32's 127 to e4m3's 7
    rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    sum_bits = (tl.abs(clamped) + _E4M3_SUBNORMAL_ROUNDER).to(tl.int32, bitcast=True)
    subnormal = sum_bits - _E4M3_SUBNORMAL_ROUNDER_BITS
    code = tl.where(magnitude < _E4M3_MIN_NORMAL_BITS, subnormal, normal)
    code = sign | tl.where(scaled != scaled, 0x7F, code)  # [sign, 4 exponent, 3 mantissa bits]
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def to_int8(scaled):
    """float32 ``scaled`` rounded to the nearest integer, ties to even, and clamped to +-127
    (NaN to 0)."""
    clamped = tl.minimum(tl.maximum(scaled, -127.0), 127.0)
    clamped = tl.where(scaled == scaled, clamped, 0.0)
    return ((clamped + _ROUND_TO_INTEGER) - _ROUND_TO_INTEGER).to(tl.int8)


@triton.jit
def _write_kv_kernel(
    cache_ptr,  # [2, num_slots, num_kv_heads, head_dim], contiguous
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    slot_mapping_ptr,  # [num_tokens]
    kv_scales_ptr,  # [2, NUM_KV_HEADS] f32: each head's K, then V scale (read if KV_QUANTIZED)
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    v_cache_offset,  # num_slots * num_kv_heads * head_dim: where V starts in the cache
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    KV_QUANTIZED: tl.constexpr,  # the cache stores float8e4nv or int8: quantize by the scales
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, NUM_KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # a padding token (slot < 0) writes no head; a scalar bool in the mask would be simpler,
    # but Triton 3.9's interpreter turns `block_bool & scalar_bool` into int32
    num_heads_written = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    # [NUM_KV_HEADS_PAD, HEAD_DIM_PAD]
    mask = (heads[:, None] < num_heads_written) & (dims[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * value_stride_token + heads[:, None] * value_stride_head + dims[None, :],
        mask=mask,
    )
    if KV_QUANTIZED:
        scales_mask = heads < NUM_KV_HEADS
        key_scales = tl.load(kv_scales_ptr + heads, mask=scales_mask, other=1.0)
        value_scales = tl.load(kv_scales_ptr + NUM_KV_HEADS + heads, mask=scales_mask, other=1.0)
        # divided by the head's scale in float32, rounded as IEEE division rounds (a plain `/`
        # compiles to an approximate division)
        key = tl.math.div_rn(key.to(tl.float32), key_scales[:, None])
        value = tl.math.div_rn(value.to(tl.float32), value_scales[:, None])
        if cache_ptr.dtype.element_ty == tl.int8:
            key, value = to_int8(key), to_int8(value)
        else:
            key, value = to_float8e4nv(key), to_float8e4nv(value)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(cache_ptr + cache_offsets, key, mask=mask)
    tl.store(cache_ptr + v_cache_offset + cache_offsets, value, mask=mask)


def write_kv_cache(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = padding token, skipped
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] f32: a quantized cache's
) -> None:
    """Write ``key``/``value`` into ``kv_cache_layer`` in place at ``slot_mapping``'s slots
    (``block_id * block_size + offset``); tokens with a negative slot are skipped. Into a
    float8_e4m3fn or int8 cache, quantized by ``kv_scales`` (row 0 each head's K scale, row 1
    its V scale; given exactly when the cache is quantized), as ``quantize_kv`` does.

    Raises ValueError naming the argument on a wrong shape, dtype, device or layout. Slots
    must be < num_blocks * block_size: checked on the host only when they are there already
    (on CPU); on a GPU the check would sync.
    """
    _check_write_args(kv_cache_layer, key, value, slot_mapping, kv_scales)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_slots = kv_cache_layer.shape[1] * kv_cache_layer.shape[2]
    if slot_mapping.device.type == "cpu":
        highest = int(slot_mapping.max())
        require(
            highest < num_slots,
            f"slot_mapping must be < num_blocks * block_size = {num_slots}, got {highest}",
        )
    _write_kv_kernel[(num_tokens,)](
        kv_cache_layer,
        key,
        value,
        slot_mapping,
        slot_mapping if kv_scales is None else kv_scales,  # (not read unless quantized)
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_slots * num_kv_heads * head_dim,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_QUANTIZED=kv_scales is not None,
    )


def _check_write_args(
    kv_cache_layer: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
) -> None:
    require_kv_cache_layer(kv_cache_layer)
    require_kv_scales(kv_scales, kv_cache_layer)
    quantized = is_quantized_cache(kv_cache_layer)
    num_kv_heads, head_dim = kv_cache_layer.shape[3], kv_cache_layer.shape[4]
    for name, tensor in (("key", key), ("value", value)):
        require(
            tensor.dim() == 3 and tuple(tensor.shape[1:]) == (num_kv_heads, head_dim),
            f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match kv_cache_layer, "
            f"got {tuple(tensor.shape)}",
        )
        if quantized:
            require(
                tensor.dtype in FLOAT_DTYPES,
                f"{name} dtype must be float32, float16 or bfloat16, got {tensor.dtype}",
            )
        else:
            require(
                tensor.dtype == kv_cache_layer.dtype,
                f"{name} dtype {tensor.dtype} != kv_cache_layer dtype {kv_cache_layer.dtype}",
            )
        require(
            tensor.stride(2) == 1 or head_dim == 1,
            f"{name} must be contiguous in head_dim (stride {tensor.stride(2)})",
        )
    require(
        value.shape[0] == key.shape[0], f"value has {value.shape[0]} tokens, key {key.shape[0]}"
    )
    require(
        slot_mapping.shape == (key.shape[0],),
        f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}",
    )
    require(
        slot_mapping.dtype in INDEX_DTYPES,
        f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}",
    )
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    require_same_device(kv_cache_layer, key=key, value=value, slot_mapping=slot_mapping)
