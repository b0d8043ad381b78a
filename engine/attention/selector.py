"""Attention backends by name: "auto" takes the Triton kernels on CUDA, and on CPU the C
decode kernel when this machine can build it, else the torch reference."""

from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionBackend, DecodeSizing
from engine.engine_config import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` stands for on ``device``; ValueError if it cannot run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}"
        )
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        if device.type == "cpu":
            reason = _cpu_kernel_missing()
            if reason is None:
                return "cpu"
            logger.warning("attention backend: torch reference on CPU (%s)", reason)
        return "torch"
    if name == "triton" and device.type != "cuda":
        from engine.kernels.checks import interpreted

        if not interpreted():
            raise ValueError(
                f"attention_backend 'triton' needs a CUDA device, got {device.type!r} "
                "(on CPU its kernels only run in Triton's interpreter, TRITON_INTERPRET=1)"
            )
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' needs the CPU device, got {device.type!r}")
        reason = _cpu_kernel_missing()
        if reason is not None:
            raise ValueError(f"attention_backend 'cpu' is unavailable here: {reason}")
    return name


def get_attention_backend(
    name: str, device: torch.device, decode_sizing: DecodeSizing | None = None
) -> AttentionBackend:
    """``decode_sizing``: the engine's, for the backends that size decode work by it."""
    resolved = resolve_attention_backend(name, device)
    if resolved == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(decode_sizing)
    if resolved == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    from engine.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def _cpu_kernel_missing() -> str | None:
    """Why the CPU backend's C kernels cannot be built or loaded here, or None when they can."""
    from engine.kernels.cpu.build import KernelUnavailableError, load

    try:
        load("paged_decode_attention")
        load("paged_prefill_attention")
        load("kv_cache_write")
    except KernelUnavailableError as error:
        return str(error)
    return None
