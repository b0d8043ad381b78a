"""Triton kernel: scatter new tokens' K/V into their slots of one layer's paged KV cache.

``kv_cache_layer[0].view(-1, num_kv_heads, head_dim)[slot_mapping[i]] = key[i]`` and the same
for value into ``kv_cache_layer[1]``, for every token ``i`` whose slot is >= 0. A negative slot
marks a padding token (a batch padded to a captured size, as vLLM pads): its K/V are dropped.

Programs: one per token (grid ``(num_tokens,)``); each moves the token's whole
``[num_kv_heads, head_dim]`` tile of K and of V, padded to powers of two and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import (
    INDEX_DTYPES,
    require,
    require_kv_cache_layer,
    require_same_device,
)


@triton.jit
def _write_kv_kernel(
    cache_ptr,  # [2, num_slots, num_kv_heads, head_dim], contiguous
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    slot_mapping_ptr,  # [num_tokens]
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    v_cache_offset,  # num_slots * num_kv_heads * head_dim: where V starts in the cache
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
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
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(cache_ptr + cache_offsets, key, mask=mask)
    tl.store(cache_ptr + v_cache_offset + cache_offsets, value, mask=mask)


def write_kv_cache(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = padding token, skipped
) -> None:
    """Write ``key``/``value`` into ``kv_cache_layer`` in place at ``slot_mapping``'s slots
    (``block_id * block_size + offset``); tokens with a negative slot are skipped.

    Raises ValueError naming the argument on a wrong shape, dtype, device or layout. Slots
    must be < num_blocks * block_size: checked on the host only when they are there already
    (on CPU); on a GPU the check would sync.
    """
    _check_write_args(kv_cache_layer, key, value, slot_mapping)
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
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_slots * num_kv_heads * head_dim,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _check_write_args(
    kv_cache_layer: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    require_kv_cache_layer(kv_cache_layer)
    num_kv_heads, head_dim = kv_cache_layer.shape[3], kv_cache_layer.shape[4]
    for name, tensor in (("key", key), ("value", value)):
        require(
            tensor.dim() == 3 and tuple(tensor.shape[1:]) == (num_kv_heads, head_dim),
            f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match kv_cache_layer, "
            f"got {tuple(tensor.shape)}",
        )
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
