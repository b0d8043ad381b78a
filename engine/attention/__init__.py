"""Attention over the paged KV cache: the layer models call and the backends behind it."""

from engine.attention.backend import AttentionBackend
from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
