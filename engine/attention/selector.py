"""Attention backends by name."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend

SUPPORTED_BACKENDS = ("torch",)


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from engine.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(
        f"attention_backend must be one of {', '.join(SUPPORTED_BACKENDS)}; got {name!r}"
    )
