"""Attention backends by name: "auto" takes the Triton kernels on CUDA, the torch reference
elsewhere."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.engine_config import ATTENTION_BACKENDS


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` stands for on ``device``; ValueError if it cannot run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}"
        )
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda":
        from engine.kernels.checks import interpreted

        if not interpreted():
            raise ValueError(
                f"attention_backend 'triton' needs a CUDA device, got {device.type!r} "
                "(on CPU its kernels only run in Triton's interpreter, TRITON_INTERPRET=1)"
            )
    return name


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    resolved = resolve_attention_backend(name, device)
    if resolved == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
