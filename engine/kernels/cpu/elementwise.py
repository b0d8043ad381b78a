"""The model's elementwise steps through the C kernels in ``elementwise.c`` (CPU, float32 and
bfloat16): RMSNorm, residual add + RMSNorm, rotary embedding of q and k in place,
SiLU(gate) * up. In bfloat16 each rounds where torch's bfloat16 ops round (so rope and the
residual sum give torch's bits; the norm and SiLU may differ by one bfloat16 step: the sum of
squares' order, exp), and computes in float32 between.

Model code asks ``usable(x)`` first and keeps its torch path for everything else (GPU, other
dtypes, a machine without a C compiler).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine.kernels.checks import require_contiguous_heads
from engine.kernels.cpu.build import FLOAT, INT64, POINTER, KernelUnavailableError, function, load

logger = logging.getLogger(__name__)
_SIGNATURES = {
    f"{name}_{suffix}": argtypes
    for name, argtypes in {
        "rms_norm": [POINTER, POINTER, POINTER, INT64, INT64, FLOAT],
        "add_rms_norm": [*(POINTER,) * 5, INT64, INT64, FLOAT],
        "rotary": [POINTER, INT64, INT64, POINTER, INT64, INT64, POINTER, POINTER, INT64, INT64],
        "silu_mul": [POINTER, POINTER, INT64, INT64],
    }.items()
    for suffix in ("f32", "bf16")
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def _library() -> Any | None:
    try:
        for symbol, argtypes in _SIGNATURES.items():
            function("elementwise", symbol, None, argtypes)
    except KernelUnavailableError as error:
        logger.warning("elementwise ops: torch on CPU (%s)", error)
        return None
    return load("elementwise")


def _kernel(name: str, dtype: torch.dtype) -> Any:
    """The C function ``name`` for tensors of ``dtype``."""
    library = _library()
    if library is None:
        raise RuntimeError("the C elementwise kernels are unavailable here: ask usable() first")
    if dtype not in _SUFFIX:
        raise ValueError(f"the C elementwise kernels take float32 or bfloat16, not {dtype}")
    return getattr(library, f"{name}_{_SUFFIX[dtype]}")


def usable(x: torch.Tensor) -> bool:
    """The C kernels take ``x``: a float32 or bfloat16 CPU tensor, on a machine that could
    build them."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim."""
    x, weight = x.contiguous(), weight.to(x.dtype).contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _kernel("rms_norm", x.dtype)(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps
    )
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x)) in one pass; [num_tokens, hidden] each."""
    residual, x = residual.contiguous(), x.to(residual.dtype).contiguous()
    weight = weight.to(x.dtype).contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    _kernel("add_rms_norm", x.dtype)(
        residual.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        total.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
    )
    return total, out


def rotary_(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads contiguous; rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], the same
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> None:
    """Rotate-half rope of q and k in place (views into the fused qkv projection's output)."""
    num_tokens, num_heads, head_dim = query.shape
    require_contiguous_heads("query", query)
    require_contiguous_heads("key", key)
    if key.dtype != query.dtype:
        raise ValueError(f"rotary_ takes q and k of one dtype, got {query.dtype} and {key.dtype}")
    cos, sin = cos.to(query.dtype).contiguous(), sin.to(query.dtype).contiguous()
    _kernel("rotary", query.dtype)(
        query.data_ptr(),
        query.stride(0),
        num_heads,
        key.data_ptr(),
        key.stride(0),
        key.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        num_tokens,
        head_dim,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [n, 2d] -> [n, d]."""
    gate_up = gate_up.contiguous()
    dim = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], dim)
    rows = gate_up.numel() // (2 * dim)
    _kernel("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, dim)
    return out
